"""vLLM as a peer and as the oracle of our `--format vllm` export (`specbatch bench --peers vllm`).

    setup.sh            vLLM's CPU build in its own virtual environment (not a dependency of ours)
    run.sh              runs Python there with the environment setup.sh recorded
    compare.py          ours and vLLM interleaved round by round: tokens/s ratios, greedy tokens, per-step K
    worker.py           vLLM as a long-lived process per engine configuration (VllmWorker)
    vllm_worker.py      its other side, run in vLLM's venv: LLM.generate, or the engine step by step
"""
