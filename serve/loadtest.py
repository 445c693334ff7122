"""`specbatch loadtest`: an open-loop client (the synergy paper's serving experiment).

Arrivals are Gamma-distributed (mean 1/rate, coefficient of variation CV; CV = 1 is Poisson), one trace per
(rate, CV, seed) shared by every policy; each request takes a held-out prompt and a max_tokens from the
range, greedy, sent at its arrival time whatever is still running. Each policy runs in its own `specbatch
serve` subprocess (or vLLM's OpenAI server for `vllm:` policies), replayed over HTTP with streaming, within
`requests` and `max_duration_s` per run; optionally also in-process (the HTTP overhead) and checked against
each prompt's solo greedy output.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .loadtest_report import CSV_COLUMNS, RequestRecord, Slo, summarize
from .loadtest_servers import (LoadtestError, ServerProcess, VllmServerProcess, engine_counters, engine_use,
                               machine_note, own_cpu_s, scrape_counters)

VLLM_PREFIX = "vllm:"
REFIT_PREFIX = "adaptive+refit="  # the adaptive policy with its step costs re-fitted online (serve --refit)


@dataclass(frozen=True)
class TraceItem:
    arrival_s: float
    prompt_index: int
    max_tokens: int
    adversarial: str | None = None  # a kind of serve.adversarial sent instead of a well-formed request


def arrival_times(count: int, rate_per_s: float, cv: float, seed: int) -> np.ndarray:
    """Cumulative arrival times (s) of `count` requests: Gamma gaps, mean 1/rate, coefficient of variation cv."""
    if rate_per_s <= 0 or cv <= 0 or count < 1:
        raise LoadtestError(f"rate ({rate_per_s}) and CV ({cv}) must be > 0 and requests ({count}) >= 1")
    shape = 1.0 / cv**2
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate_per_s * shape), size=count)
    return np.cumsum(gaps)


def make_trace(count: int, rate_per_s: float, cv: float, seed: int, prompts: int,
               max_tokens: tuple[int, int], adversarial_share: float = 0.0) -> list[TraceItem]:
    """The arrivals; a seeded `adversarial_share` of them send serve.adversarial's kinds instead, in turn."""
    from .adversarial import KINDS

    times = arrival_times(count, rate_per_s, cv, seed)
    lengths = np.random.default_rng(seed + 1).integers(max_tokens[0], max_tokens[1] + 1, size=count)
    hostile = np.flatnonzero(np.random.default_rng(seed + 2).random(count) < adversarial_share)
    kinds = {int(i): KINDS[j % len(KINDS)] for j, i in enumerate(hostile)}
    return [TraceItem(float(t), i % prompts, int(n), kinds.get(i)) for i, (t, n) in enumerate(zip(times, lengths))]


OUTPUT_KINDS = {"loadtest.json": "specbatch.loadtest", "loadtest.csv": "csv:" + ",".join(CSV_COLUMNS),
                "latency.png": "image"}  # what run_loadtest writes, as perfmodel.jsonio.check_replace names kinds


@dataclass(frozen=True)
class LoadtestConfig:
    policies: tuple[str, ...]  # 'table', 'k=K', 'tree=SPEC', 'adaptive=MODEL.json', 'adaptive+refit=MODEL.json'
    rates_per_s: tuple[float, ...]
    cvs: tuple[float, ...] = (1.0,)
    requests: int = 100
    max_duration_s: float = 120.0
    max_tokens: tuple[int, int] = (64, 128)
    seed: int = 0
    slo: Slo = Slo()
    prompts: tuple[str, ...] = ()
    server_args: tuple[str, ...] = ()  # passed to every `specbatch serve` (--target, --table, --threads, ...)
    in_process: bool = False  # also replay each trace on the engine in this process
    check_greedy: bool = False  # compare every response with its prompt's solo greedy output
    adversarial_share: float = 0.0  # share of the arrivals that are hostile requests (serve.adversarial)
    startup_timeout_s: float = 600.0  # a server without --table measures a quick profile first
    # vllm:* policies: the pair's directories, the table to export, vLLM's max_num_seqs
    vllm_target: Path | None = None
    vllm_draft: Path | None = None
    vllm_table: Path | None = None
    vllm_max_num_seqs: int = 32


def vllm_speculative_config(config: LoadtestConfig, policy: str) -> dict | None:
    """What `vllm:table` / `vllm:k=K` pass to vLLM's --speculative-config (None: plain decoding)."""
    from specbatch.calibrate.errors import CalibrationError
    from specbatch.calibrate.vllm_steps import vllm_method
    from specbatch.perfmodel.table import load_table, to_vllm

    name = policy.removeprefix(VLLM_PREFIX)
    if name == "table":
        if config.vllm_table is None:
            raise LoadtestError(f"policy {policy}: give --table FILE (its --format vllm export is what vLLM runs)")
        from specbatch.bench.vllm.compare import VllmError, check_chains_only

        table = load_table(config.vllm_table)
        try:
            check_chains_only(table, f"--table {config.vllm_table}")
            vllm_method(table.drafter, str(config.vllm_draft))
        except (VllmError, CalibrationError) as error:
            raise LoadtestError(f"policy {policy}: {error}") from None
        return to_vllm(table, draft=config.vllm_draft)
    if name.startswith("k=") and name[2:].isdigit():
        from specbatch.perfmodel.exports import checkpoint_drafter

        k = int(name[2:])
        try:  # the draft model, or the head --draft names (its kind from its config.json)
            method = vllm_method(checkpoint_drafter(str(config.vllm_draft)) or "draft_model", str(config.vllm_draft))
        except CalibrationError as error:
            raise LoadtestError(f"policy {policy}: {error}") from None
        return None if k == 0 else {"method": method, "model": str(config.vllm_draft), "num_speculative_tokens": k}
    raise LoadtestError(f"policy {policy!r}: expected vllm:table or vllm:k=K")


def check_vllm_policies(config: LoadtestConfig) -> None:
    """vllm:* policies are refused before any server starts when vLLM cannot run them."""
    if not any(p.startswith(VLLM_PREFIX) for p in config.policies):
        return
    from specbatch.bench.vllm.compare import vllm_missing

    if (missing := vllm_missing()) is not None:
        raise LoadtestError(f"--policies: {missing}")
    for option, directory in (("--target", config.vllm_target), ("--draft", config.vllm_draft)):
        if directory is None or not Path(directory).is_dir():
            raise LoadtestError(f"vllm:* policies need the pair's model directories: {option} {directory} is not one")
    for policy in config.policies:
        if policy.startswith(VLLM_PREFIX):
            vllm_speculative_config(config, policy)


def server_for(config: LoadtestConfig, policy: str, log_path: Path) -> ServerProcess:
    if policy.startswith(VLLM_PREFIX):
        speculative = vllm_speculative_config(config, policy)
        extra = [] if speculative is None else ["--speculative-config", json.dumps(speculative)]
        return VllmServerProcess(extra, log_path, target_dir=str(config.vllm_target),
                                 max_num_seqs=config.vllm_max_num_seqs)
    return ServerProcess(server_command_args(config.server_args, policy), log_path)


def policy_args(policy: str) -> list[str]:
    if policy == "table":
        return []
    if policy.startswith("k="):
        return ["--k", policy[2:]]
    if policy.startswith("tree="):
        return ["--tree", policy[5:]]
    if policy.startswith("adaptive="):
        return ["--adaptive", policy[9:]]
    if policy.startswith(REFIT_PREFIX):
        return ["--adaptive", policy.removeprefix(REFIT_PREFIX), "--refit"]
    raise LoadtestError(f"policy {policy!r}: expected table, k=K, tree=SPEC, adaptive=MODEL.json or "
                        "adaptive+refit=MODEL.json")


def server_command_args(server_args: tuple[str, ...], policy: str) -> list[str]:
    """A server's arguments for one policy: --table (for the 'table' policy) is dropped for the others,
    which serve refuses to combine with it."""
    pairs = list(zip(server_args[::2], server_args[1::2]))
    kept = [x for flag, value in pairs if policy == "table" or flag != "--table" for x in (flag, value)]
    return [*kept, *policy_args(policy)]


async def replay_http(url: str, model: str, trace: list[TraceItem], prompts: tuple[str, ...],
                      max_duration_s: float, want_ids: bool) -> list[RequestRecord]:
    """Send the trace open-loop (streaming completions) and time each request; a hostile arrival is sent
    as its kind and judged by the answer the server must give."""
    import httpx

    from .adversarial import send_adversarial

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(max_duration_s + 60), limits=limits) as client:
        start = time.perf_counter()

        async def one(item: TraceItem, record: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
            record.sent_s = time.perf_counter() - start
            if item.adversarial is not None:
                outcome = await send_adversarial(client, url, item.adversarial, model, prompts[item.prompt_index],
                                                 item.max_tokens)
                record.adversarial, record.as_expected = item.adversarial, outcome.as_expected
                record.finished_s = time.perf_counter() - start
                record.error = None if outcome.as_expected else outcome.detail
                return
            body = {"model": model, "prompt": prompts[item.prompt_index], "max_tokens": item.max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": want_ids}
            ids: list[int] = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}: {server_reason(await response.aread())}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        record.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        if record.first_token_s is None and (choice["text"] or choice.get("token_ids")):
                            record.first_token_s = time.perf_counter() - start
                        ids.extend(choice.get("token_ids") or [])
                        record.finish_reason = choice["finish_reason"] or record.finish_reason
            record.finished_s = time.perf_counter() - start
            record.token_ids = ids if want_ids else None

        return await _run_all(trace, one, start, max_duration_s)


def server_reason(body: bytes, limit: int = 200) -> str:
    """What a server said with an error status: the OpenAI error object's message (vLLM's older servers put it at
    the top level), else the body's start; a record keeps this beside the status."""
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict):
        error = value.get("error")
        message = error.get("message") if isinstance(error, dict) else value.get("message")
        if isinstance(message, str) and message:
            return message[:limit]
    text = body.decode("utf-8", "replace").strip()
    return text[:limit] if text else "no reason given"


async def _run_all(trace, one, start: float, max_duration_s: float) -> list[RequestRecord]:
    """Run `one(item, record)` for every arrival within the duration; cut what is left at the end."""
    records = [RequestRecord(i, None) for i, item in enumerate(trace) if item.arrival_s <= max_duration_s]

    async def guarded(item, record):
        try:
            await one(item, record)
        except asyncio.CancelledError:
            record.error = "unfinished"
            raise
        except Exception as error:  # noqa: BLE001 - a failed request is a figure of the run, not a crash
            record.error = f"{type(error).__name__}: {error}"

    tasks = [asyncio.create_task(guarded(item, record)) for item, record in zip(trace, records)]
    if not tasks:  # no arrival within the duration
        return records
    _done, pending = await asyncio.wait(tasks, timeout=max(0.0, start + max_duration_s - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.error is None and record.finished_s is None:
            record.error = "unfinished"
    return records


def well_formed(trace: list[TraceItem]) -> list[TraceItem]:
    """The arrivals the in-process replay sends: hostile ones are HTTP requests (bodies, connections), so the
    in-process row neither sends nor counts them."""
    return [item for item in trace if item.adversarial is None]


async def replay_engine(runner, encode, trace: list[TraceItem], prompts: tuple[str, ...],
                        max_duration_s: float) -> list[RequestRecord]:
    """The same trace straight into an engine in this process (no HTTP): the HTTP layer's cost. Give it the
    well-formed arrivals (`well_formed`): each record's index is its position in `trace`."""
    from specbatch.runtime.engine import Request

    if any(item.adversarial is not None for item in trace):
        raise LoadtestError("the in-process replay sends well-formed requests only: give it well_formed(trace)")
    loop = asyncio.get_running_loop()
    encoded = {i: tuple(encode(p)) for i, p in enumerate(prompts)}
    start = time.perf_counter()

    async def one(item: TraceItem, record: RequestRecord) -> None:
        await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
        record.sent_s = time.perf_counter() - start
        stream = runner.submit(Request(f"r{record.index}", encoded[item.prompt_index], item.max_tokens), loop)
        ids: list[int] = []
        try:
            while True:
                event = await stream.next()
                if event.token_ids and record.first_token_s is None:
                    record.first_token_s = time.perf_counter() - start
                ids.extend(event.token_ids)
                if event.finish_reason:
                    break
        except asyncio.CancelledError:
            runner.engine.cancel(f"r{record.index}")
            raise
        record.finished_s = time.perf_counter() - start
        record.completion_tokens, record.token_ids, record.finish_reason = len(ids), ids, event.finish_reason

    return await _run_all(trace, one, start, max_duration_s)


def run_policy(config: LoadtestConfig, policy: str, traces: dict, out: Path, references, on_run=None) -> list[dict]:
    """Start the policy's server, replay every trace through it, stop it; one summary per trace."""
    server = server_for(config, policy, out / f"server-{_slug(policy)}.log")
    server.start(config.startup_timeout_s)
    runs = []
    try:
        import httpx

        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        for (rate, cv), trace in traces.items():
            rss_before, counters, cpu = server.rss_mb(), scrape_counters(server.url), (server.cpu_s(), own_cpu_s())
            records = asyncio.run(replay_http(server.url, model, trace, config.prompts, config.max_duration_s,
                                              references is not None))
            run = _summary(policy, "http", rate, cv, trace, records, config, references)
            run.update(rss_before_mb=rss_before, rss_after_mb=server.rss_mb(), server_cpu_s=server.cpu_s() - cpu[0],
                       client_cpu_s=own_cpu_s() - cpu[1], **engine_use(counters, scrape_counters(server.url), run))
            runs.append(run)
            if on_run:
                on_run(run)
    finally:
        code = server.stop()
    for run in runs:
        run["server_exit_code"] = code
    return runs


def run_in_process(config: LoadtestConfig, policy: str, traces: dict, references, on_run=None) -> list[dict]:
    """The same traces on the engine in this process, built as `serve` builds it."""
    from .server import build

    options = _serve_options(config.server_args, policy)
    runner, served = build(options)
    runner.start()
    runs = []
    try:
        for (rate, cv), trace in traces.items():
            counters, cpu = engine_counters(runner.engine.metrics.snapshot()), own_cpu_s()
            replayed = well_formed(trace)  # its figures count what it replays, indexed as the records are
            records = asyncio.run(replay_engine(runner, served.encode, replayed, config.prompts,
                                                config.max_duration_s))
            run = _summary(policy, "in-process", rate, cv, replayed, records, config, references)
            run.update(server_cpu_s=own_cpu_s() - cpu, client_cpu_s=None,
                       **engine_use(counters, engine_counters(runner.engine.metrics.snapshot()), run))
            runs.append(run)
            if on_run:
                on_run(runs[-1])
    finally:
        runner.stop()
    return runs


def _serve_options(server_args: tuple[str, ...], policy: str):
    """ServeOptions from the same argument list a server subprocess gets (the flags loadtest passes on)."""
    from .server import ServeOptions

    names = {"--target": ("target", str), "--draft": ("draft", str), "--table": ("table", Path),
             "--k": ("k", int), "--tree": ("tree", str), "--max-batch-size": ("max_batch_size", int),
             "--kv-budget-tokens": ("kv_budget_tokens", int), "--threads": ("threads", int),
             "--device": ("device", str), "--dtype": ("dtype", str), "--profile": ("profile", Path),
             "--max-waiting": ("max_waiting", int), "--adaptive": ("adaptive", Path)}
    args = server_command_args(server_args, policy)
    values = {}
    if "--refit" in args:  # the one flag without a value
        args.remove("--refit")
        values["refit"] = True
    for flag, value in zip(args[::2], args[1::2]):
        if flag not in names:
            raise LoadtestError(f"{flag} is not passed on to the in-process engine")
        name, kind = names[flag]
        values[name] = kind(value)
    return ServeOptions(**values)


def _summary(policy, mode, rate, cv, trace, records, config, references) -> dict:
    mismatched = None
    if references is not None:
        mismatched = sum(1 for r in records if r.ok and r.adversarial is None and r.token_ids !=
                         references(trace[r.index].prompt_index, trace[r.index].max_tokens))
    return {"policy": policy, "mode": mode, "rate_per_s": rate, "cv": cv,
            **summarize(records, len(trace), config.slo, mismatched)}


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "=-_." else "_" for c in text)


def solo_references(config: LoadtestConfig):
    """prompt index, max_tokens -> the prompt's solo greedy output (the target alone, one prompt at a time,
    generated once per prompt at the largest max_tokens: greedy outputs of fewer tokens are its prefixes), on
    the server's device and in its dtype: in bfloat16 or float16 a speculative server's output may still part
    from it at a near tie of the target's logits (docs/validation.md), which counts as a mismatch."""
    import torch

    from specbatch.runtime.assembly import load_named_pair
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK

    options = _serve_options(config.server_args, "k=0")
    pair = load_named_pair(options.target, None, options.device, options.dtype, need_draft=False)  # as serve does
    generator = SpeculativeGenerator(pair.target, None, pair.eos_token_ids)
    cache: dict[int, list[int]] = {}

    def reference(prompt_index: int, max_tokens: int) -> list[int]:
        if prompt_index not in cache:
            with torch.inference_mode():
                ids = pair.tokenizer.encode(config.prompts[prompt_index])
                cache[prompt_index] = generator.generate([ids], config.max_tokens[1], FixedK(0)).token_ids[0]
        return cache[prompt_index][:max_tokens]

    return reference


def candidate_set_notes(config: LoadtestConfig) -> list[str]:
    """Where the table and an adaptive policy choose among different strategies: a table without second-stage
    entries against a model that measured the second stage: adaptive then runs staged chains the table
    never does, and the comparison is of candidate sets, not of adapting."""
    table_args = dict(zip(config.server_args[::2], config.server_args[1::2]))
    adaptive = [p.split("=", 1)[1] for p in config.policies if p.startswith(("adaptive=", REFIT_PREFIX))]
    if "table" not in config.policies or "--table" not in table_args or not adaptive:
        return []
    from specbatch.perfmodel.model import load_model
    from specbatch.perfmodel.table import load_table

    if load_table(Path(table_args["--table"])).stage2 is not None:
        return []
    return [f"the table {table_args['--table']} has no second-stage entries but {path} measured the second stage: "
            "adaptive may run staged chains the table never does; for a like-for-like comparison give a table "
            "computed with every strategy (specbatch table's default)"
            for path in adaptive if load_model(Path(path)).stage2 is not None]


def check_config(config: LoadtestConfig) -> None:
    """Numbers that cannot describe a run are refused before any server starts."""
    if not config.prompts:
        raise LoadtestError("no prompts")
    if config.requests < 1:
        raise LoadtestError(f"--requests {config.requests}: give at least 1")
    if not config.max_duration_s > 0:
        raise LoadtestError(f"--max-duration-s {config.max_duration_s:g}: give a positive number of seconds")
    for name, values in (("--rates", config.rates_per_s), ("--cvs", config.cvs)):
        if not values or not all(value > 0 and math.isfinite(value) for value in values):
            raise LoadtestError(f"{name} {','.join(f'{v:g}' for v in values)}: every value must be > 0")
    for name, limit_ms in (("--slo-ttft-ms", config.slo.ttft_ms), ("--slo-tpot-ms", config.slo.tpot_ms),
                           ("--slo-e2e-ms", config.slo.e2e_ms)):
        if limit_ms is not None and not (limit_ms > 0 and math.isfinite(limit_ms)):
            raise LoadtestError(f"{name} {limit_ms:g}: give a positive number of milliseconds")
    if not 0.0 <= config.adversarial_share <= 0.5:
        raise LoadtestError(f"--adversarial {config.adversarial_share}: give a share in [0, 0.5]")


def run_loadtest(config: LoadtestConfig, out: Path, on_run=None) -> dict:
    """Every policy against the same traces; writes loadtest.json, loadtest.csv and latency.png in `out`."""
    import torch

    from specbatch.perfmodel.jsonio import make_dir, write_json_atomic, write_text_atomic

    from .loadtest_report import plot_latency, to_csv

    check_config(config)
    check_vllm_policies(config)
    notes = candidate_set_notes(config)
    make_dir(out, "--out")
    torch.set_num_threads(1)  # this process shares the machine with the server it measures
    traces = {(rate, cv): make_trace(config.requests, rate, cv, config.seed, len(config.prompts), config.max_tokens,
                                     config.adversarial_share)
              for cv in config.cvs for rate in config.rates_per_s}
    references = solo_references(config) if config.check_greedy else None
    machine_before = machine_note()
    runs = []
    for policy in config.policies:
        runs += run_policy(config, policy, traces, out, references, on_run)
        if config.in_process and not policy.startswith(VLLM_PREFIX):  # in-process means our engine
            runs += run_in_process(config, policy, traces, references, on_run)
    report = {"schema": "specbatch.loadtest/1", "machine_before": machine_before, "machine_after": machine_note(),
              "config": {"policies": list(config.policies), "rates_per_s": list(config.rates_per_s),
                         "cvs": list(config.cvs), "requests": config.requests, "max_duration_s": config.max_duration_s,
                         "max_tokens": list(config.max_tokens), "seed": config.seed, "slo": config.slo.describe(),
                         "adversarial_share": config.adversarial_share,
                         "server_args": list(config.server_args), "torch_threads_client": 1},
              "runs": runs, "notes": notes}
    write_json_atomic(out / "loadtest.json", report, "--out")
    write_text_atomic(out / "loadtest.csv", to_csv(runs), "--out")
    plot_latency(runs, out / "latency.png")
    return report
