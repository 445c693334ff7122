"""vLLM's side of bench/vllm/compare.py: runs INSIDE vLLM's virtual environment (bash bench/vllm/run.sh).

    python vllm_worker.py REQUEST.json

REQUEST: {"target", "max_new_tokens", "batch_sizes": [1, 8, ...], "prompts": [[token ids], ...] (at least the
largest batch size), "configs": {name: speculative_config or null (plain decoding)}}. For every config one
`LLM` (float32 like our CPU runtime, enforce_eager, in-process engine core from run.sh's environment), then
for every batch size a warm-up `generate` on the first b prompts (the first use of each shape pays allocator
costs) and a timed one: greedy, `max_tokens` = max_new_tokens, stopping at EOS as ours does. Writes nothing:
one line `SPECBATCH_RESULT {json}` on stdout, {config: {str(b): {"token_ids", "wall_s", "k_per_step"}}},
where k_per_step is [[batch size, K], ...] as vLLM's scheduler looked them up (recorded on its dense
schedule, vllm/v1/core/sched/scheduler.py: `self.dynamic_sd_lookup[len(num_scheduled_tokens)]`).
"""
from __future__ import annotations

import json
import sys
import time


class RecordedLookup(list):
    """vLLM's dense batch size -> K list, recording every lookup the scheduler makes."""

    def __init__(self, dense: list[int]):
        super().__init__(dense)
        self.seen: list[list[int]] = []

    def __getitem__(self, batch_size):
        k = super().__getitem__(batch_size)
        self.seen.append([batch_size, k])
        return k


def run_config(request: dict, speculative_config: dict | None) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["target"], speculative_config=speculative_config, dtype="float32", enforce_eager=True,
              max_num_seqs=max(request["batch_sizes"]), max_model_len=1024, seed=0)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0
    recorder = None
    if scheduler.dynamic_sd_lookup is not None:
        recorder = scheduler.dynamic_sd_lookup = RecordedLookup(scheduler.dynamic_sd_lookup)
    # token ids in and out, as ours: no detokenization in the timed loop
    greedy = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], detokenize=False)
    results = {}
    for batch_size in request["batch_sizes"]:
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"][:batch_size]]
        llm.generate(prompts, greedy, use_tqdm=False)  # warm-up
        if recorder is not None:
            recorder.seen.clear()
        start_s = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        wall_s = time.perf_counter() - start_s
        results[str(batch_size)] = {"token_ids": [list(out.outputs[0].token_ids) for out in outputs],
                                    "wall_s": wall_s, "k_per_step": list(recorder.seen) if recorder else []}
    del llm
    return results


def main(request_path: str) -> None:
    with open(request_path, encoding="utf-8") as file:
        request = json.load(file)
    results = {name: run_config(request, config) for name, config in request["configs"].items()}
    print("SPECBATCH_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
