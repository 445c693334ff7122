"""`specbatch bench`: check a table (and the performance model behind it) against real generation.

For every batch size b the harness generates from the same b prompts with plain decoding (k = 0), every
fixed k, the table, fixed draft trees, the same with the n-gram second stage and, optionally, peers
(transformers, vLLM), and measures generated tokens per second (steady state and wall time).

    config.py         BenchConfig and its checks, BenchModels (the pair under test), BenchError
    assembly.py       the pair, prompts and second stage a user names, loaded for a run
    workload.py       the prompts of every round (one population, or two mixed or switched)
    policies.py       the contenders: their stable names (k=K, table, tree:SPEC, +ngram) and runtime policies
    plan.py           what a run measures and every check before measuring; the order of each round
    rounds.py         interleaved rounds at every batch size, extra paired rounds, vLLM
    harness.py        run_bench = plan, rounds, summary
    timing.py         one wall clock for ours and the peers; our generations one by one or in lockstep
    peers.py          transformers as a peer
    results.py        RunRecord -> PolicyResult -> BatchResult -> BenchResult
    regret.py         the table's paired regret with its bootstrap interval
    predict.py        the performance model's goodput beside the measurements; --tree auto
    explain_steps.py  the prediction error term by term (`specbatch explain` and bench's decomposition)
    speed.py          the machine's speed against calibration's (the reference pass timed again)
    outputs.py        bench.json (specbatch.bench/1), bench.csv and the PNG plots
    vllm/             vLLM's CPU build as a peer, in its own virtual environment

Dependencies point one way: console -> bench -> calibrate, runtime, perfmodel. Nothing is imported here.
"""
