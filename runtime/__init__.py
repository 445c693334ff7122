"""The runtime: our torch models, their KV caches, batched speculative decoding and its policies.

What differs between devices lives in runtime.devices. Importing this package bounds how long an idle OpenMP
thread spins before it sleeps (runtime.devices.cpu.GOMP_SPINCOUNT unless the environment says otherwise): it
must be set before `import torch`, so `cli.py` and the tests import this package first.
"""
import os

from .devices.cpu import GOMP_SPINCOUNT

os.environ.setdefault("GOMP_SPINCOUNT", str(GOMP_SPINCOUNT))
