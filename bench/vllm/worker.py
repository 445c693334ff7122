"""vLLM as a long-lived process in its own virtual environment (setup.sh, run.sh): one `VllmWorker` per engine
configuration, answering one run at a time (vllm_worker.py is its other side).

    worker = VllmWorker("spec", target_dir, max_num_seqs, speculative_config, workdir)
    worker.generate(prompts, 64)                                         # LLM.generate, timed whole
    worker.steps(prompts, 64, schedule=[[1, 64, 3]], decode_steps=12)    # step by step, with vLLM's metrics
    worker.start(prompts, 64); worker.step() ...; worker.finish()         # the same, one step per call (lockstep)
    worker.close()

Everything that can go wrong (not set up, a configuration vLLM refuses, a worker that dies) is a VllmError with
a one-line message naming the worker's log.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from specbatch.perfmodel.errors import SpecbatchError

HERE = Path(__file__).resolve().parent
RUN_SH, WORKER = HERE / "run.sh", HERE / "vllm_worker.py"


class VllmError(SpecbatchError):
    """vLLM is not set up, refused our configuration, or its worker died; the message is one line."""


def vllm_venv() -> Path:
    return Path(os.environ.get("SPECBATCH_VLLM_VENV", HERE / ".venv"))


def vllm_missing() -> str | None:
    """Why vLLM cannot run here (one line), or None when its environment is set up."""
    venv = vllm_venv()
    if not (venv / "bin" / "python").exists() or not (venv / "specbatch-vllm.env").exists():
        return f"vLLM is not set up in {venv}: run 'bash bench/vllm/setup.sh' (minutes, ~3.5 GB) first"
    return None


def thread_env(threads: int | None) -> dict[str, str] | None:
    """The environment of a worker on `threads` OpenMP threads that vLLM leaves unbound (None: vLLM's own
    choice, VLLM_CPU_OMP_THREADS_BIND=auto: one thread bound to each core). Bound threads wait for each other
    at every parallel region, so on a machine shared with other work they run at the pace of the busiest core;
    unbound, the OS moves them to whichever core is free (vllm/utils/ompmultiprocessing.py: 'nobind' leaves
    OMP_NUM_THREADS as given)."""
    if threads is None:
        return None
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}


class VllmWorker:
    """One vllm_worker.py process, one engine configuration, kept up for a whole comparison or calibration.
    `version`, `torch_threads`, `torch_version` and `num_speculative_tokens` are what the engine reported."""

    def __init__(self, name: str, target_dir: Path, max_num_seqs: int, speculative_config: dict | None,
                 workdir: Path, threads: int | None = None):
        from specbatch.perfmodel.jsonio import write_json_atomic

        if (missing := vllm_missing()) is not None:
            raise VllmError(missing)
        config_path = workdir / f"{name}.config.json"
        write_json_atomic(config_path, speculative_config)
        self.name, self.log_path = name, workdir / f"vllm-{name}.log"
        self.log = open(self.log_path, "w", encoding="utf-8")
        self.process = subprocess.Popen(
            ["bash", str(RUN_SH), str(WORKER), str(Path(target_dir).resolve()), str(max_num_seqs), str(config_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=thread_env(threads))
        ready = self._answer("SPECBATCH_READY")
        self.version, self.torch_threads = ready["version"], ready.get("torch_threads")
        self.torch_version = ready.get("torch_version")
        self.num_speculative_tokens = ready.get("num_speculative_tokens", 0)

    def _answer(self, marker: str) -> dict:
        for line in self.process.stdout:
            if line.startswith(marker + " "):
                answer = json.loads(line[len(marker) + 1:])
                if "error" in answer:
                    raise VllmError(f"vLLM worker '{self.name}' refused the run: {answer['error']}")
                return answer
        code = self.process.wait()
        self.log.flush()
        tail = [line for line in self.log_path.read_text(encoding="utf-8").splitlines() if line.strip()][-1:]
        raise VllmError(f"vLLM worker '{self.name}' exited ({code}): {tail[0] if tail else 'no output'} "
                        f"(log: {self.log_path})")

    def _run(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer("SPECBATCH_RESULT")

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        """One `LLM.generate` of the prompts: {"token_ids", "wall_s", "k_per_step"}."""
        return self._run({"prompts": prompts, "max_new_tokens": max_new_tokens})

    def steps(self, prompts: list[list[int]], max_new_tokens: int, schedule: list | None = None,
              cap: int | None = None, decode_steps: int | None = None) -> dict:
        """The prompts run step by step (vllm_worker.py): {"token_ids", "wall_s", "steps", "metrics",
        "k_per_step"}; `schedule` (inclusive [start, end, K] runs, capped by `cap`) replaces the engine's."""
        return self._run({"prompts": prompts, "max_new_tokens": max_new_tokens, "steps": True,
                          "schedule": schedule, "cap": cap, "decode_steps": decode_steps})

    def start(self, prompts: list[list[int]], max_new_tokens: int, schedule: list | None = None,
              cap: int | None = None) -> None:
        """The prompts' requests added; `step` advances them one engine step, `finish` answers as `steps`."""
        self._run({"op": "start", "prompts": prompts, "max_new_tokens": max_new_tokens, "schedule": schedule,
                   "cap": cap})

    def step(self) -> dict:
        """One engine step of the run started: {"step": its record or None, "done"}."""
        return self._run({"op": "step"})

    def finish(self) -> dict:
        return self._run({"op": "finish"})

    def close(self) -> None:
        try:
            self.process.stdin.close()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.log.close()
