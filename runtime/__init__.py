"""The runtime: our torch models, their KV caches, batched speculative decoding and its policies.

Importing this package bounds how long an idle OpenMP thread spins before it sleeps (`GOMP_SPINCOUNT=10000`
unless the environment says otherwise; libgomp's default is 300,000): where other busy processes share the
cores, long spinning barriers wait for descheduled threads and every forward pass slows down many times over
with no error. It must be set before `import torch`, so `cli.py` and the tests import this package first.
"""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
