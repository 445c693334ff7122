"""`specbatch bench`: check a table (and the performance model behind it) against real generation.

For every batch size b the harness generates from the same b prompts with plain decoding (k = 0),
every fixed k, the table policy, fixed draft trees, the same chains and trees with the n-gram second
stage and, optionally, Hugging Face `generate` as a peer, and measures generated tokens per second of
wall time (prefill, every forward pass and all bookkeeping included).

    config.py    BenchConfig and its checks, BenchModels (the pair under test), BenchError
    policies.py  the contenders: their stable names (k=K, table, tree:SPEC, +ngram) and runtime policies
    harness.py   run_bench: interleaved rounds at every batch size, prompts, the checks before measuring
    timing.py    one wall clock for ours and the peers; one timed generation of ours
    peers.py     transformers as a peer: loading the pair, one timed generate() call
    results.py   RunRecord -> PolicyResult -> BatchResult -> BenchResult: medians, regret, comparisons
    predict.py   the performance model's goodput beside the measurements; --tree auto
    outputs.py   bench.json (specbatch.bench/1), bench.csv and the PNG plots

Dependencies point one way: cli -> bench -> calibrate (the device's name), runtime, perfmodel.
Nothing is imported here.
"""
