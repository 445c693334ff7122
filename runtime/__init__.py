"""The runtime: our torch models, their KV caches, batched speculative decoding and its policies.

Importing this package sets one process-wide default before torch starts its OpenMP runtime: idle
OpenMP threads sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`, unless the environment already
says otherwise). Why: with two cores and any other busy process, torch's default spinning barriers
wait for a thread the kernel has descheduled, and every forward pass slows down 10-100x with no
error (measured on the development VM under a load of ~10: a demo-target pass of 8 x 64 tokens took
4.7-5.7 s with the default and 0.09-0.6 s with PASSIVE; see docs/measurements.md). It must be set
before `import torch`, so `cli.py` and the tests import this package first.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
