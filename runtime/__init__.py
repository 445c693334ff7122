"""The runtime: our torch models, their KV caches, batched speculative decoding and its policies.

Importing this package sets one process-wide default before torch starts its OpenMP runtime: an idle
OpenMP thread spins for at most 10,000 iterations before it sleeps (`GOMP_SPINCOUNT=10000`, unless the
environment already says otherwise; libgomp's default is 300,000). Why: with two cores and any other
busy process, long spinning barriers wait for a thread the kernel has descheduled, and every forward
pass slows down 10-100x with no error. Measured on the 2-core development VM, demo target, 2 threads,
median ms of one pass (1 x 8 tokens / 8 x 64 tokens):
    idle:                    libgomp default 5.8 / 64,  spin 10k 7.6 / 56,  OMP_WAIT_POLICY=PASSIVE 11.1 / 69
    two busy processes:      libgomp default 464 / 256, spin 10k 19.6 / 161, PASSIVE 29 / 113, 1 thread 7.3 / 148
so the bounded spin costs little when idle and removes most of the collapse; the CLI also drops to one
thread when the machine is already busy at start-up (console/options.set_threads). It must be set
before `import torch`, so `cli.py` and the tests import this package first.
"""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
