"""`specbatch serve` and `specbatch loadtest`: thin commands (options, then one library call); the engine
is runtime/engine.py, the HTTP server and the load test live in serve/. cli.py registers them."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from specbatch.perfmodel.errors import UsageError
from specbatch.runtime.assembly import DEMO_PROMPTS, DEMO_TARGET, default_draft

from .options import DeviceOpt, DraftOpt, DtypeOpt, ForceOpt, RefitOpt, ReplaceOpt, TargetOpt, read_prompts_file


def serve_command(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    table: Annotated[Optional[Path], typer.Option(
        "--table", help="specbatch.table/1 file (default: computed at start-up from a quick profile).")] = None,
    k: Annotated[Optional[int], typer.Option(
        "--k", help="Fixed speculation length instead of a table (0: none).")] = None,
    tree: Annotated[Optional[str], typer.Option(
        "--tree", help="A fixed draft tree (rank paths like 0,1,0.0) instead of a table.")] = None,
    adaptive: Annotated[Optional[Path], typer.Option(
        "--adaptive", help="specbatch.model/1 file: choose k every step from the model and each request's "
                           "acceptance learned online, instead of a table.")] = None,
    refit: RefitOpt = False,
    host: Annotated[str, typer.Option(
        "--host", help="Address to bind (loopback by default; there is no authentication).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    max_batch_size: Annotated[int, typer.Option(
        "--max-batch-size", help="Running requests at most (the table's largest batch).")] = 32,
    kv_budget_tokens: Annotated[Optional[int], typer.Option(
        "--kv-budget-tokens",
        help="KV tokens running requests may reserve (prompt + max_tokens + draft margin each).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(
        "--max-model-len", help=(
            "Prompt + max_tokens of one request at most; every KV slot is sized for it (default: the models' "
            "context). The KV memory is max-batch-size x this x both models' bytes per token."))] = None,
    kv_cache_gb: Annotated[Optional[float], typer.Option(
        "--kv-cache-gb", help=(
            "GiB both models' KV slots may take; the running requests are capped at the slots that fit "
            "(default: 90 % of a GPU's free memory, half of a CPU machine's, after loading the models)."))] = None,
    eager: Annotated[bool, typer.Option(
        "--eager", help="Run every pass eagerly instead of replaying CUDA graphs (on CUDA, graphs are the default: "
                        "one per batch bucket and width, captured on first use).")] = False,
    allow_mode_mismatch: Annotated[bool, typer.Option(
        "--allow-mode-mismatch", help="Serve with a table or model measured in the other execution mode (eager "
                                      "vs CUDA graphs).")] = False,
    max_waiting: Annotated[int, typer.Option(
        "--max-waiting", help="Queued requests beyond which new ones get 429.")] = 1024,
    max_tokens_limit: Annotated[int, typer.Option(
        "--max-tokens-limit", help="The largest max_tokens a request may ask for.")] = 1024,
    profile: Annotated[Optional[Path], typer.Option(
        "--profile", help="Quick-profile file to reuse or write (default: the user cache directory).")] = None,
    threads: Annotated[Optional[int], typer.Option(
        "--threads", help="torch intra-op threads (default: torch's).")] = None,
    model_name: Annotated[Optional[str], typer.Option(
        "--model-name", help="Model name clients send (default: the target directory's name).")] = None,
    drain_s: Annotated[float, typer.Option(
        "--drain-s", help="Seconds in-flight requests get at SIGINT/SIGTERM before they are cancelled.")] = 30.0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    force: ForceOpt = False,
):
    """Serve the pair over an OpenAI-compatible HTTP API with continuous batching; the table picks k every step."""
    from specbatch.serve.server import ServeOptions, serve

    serve(ServeOptions(target=target, draft=draft, table=table, k=k, tree=tree, adaptive=adaptive, refit=refit,
                       host=host, port=port,
                       max_batch_size=max_batch_size, kv_budget_tokens=kv_budget_tokens, max_waiting=max_waiting,
                       max_model_len=max_model_len, kv_cache_gb=kv_cache_gb, cuda_graphs=False if eager else None,
                       allow_mode_mismatch=allow_mode_mismatch,
                       max_tokens_limit=max_tokens_limit, device=device, dtype=dtype, profile=profile,
                       threads=threads, model_name=model_name, drain_s=drain_s, force=force))


def loadtest_command(
    policies: Annotated[str, typer.Option("--policies", help=(
        "Comma list: table, k=K, tree=SPEC, adaptive=MODEL.json, adaptive+refit=MODEL.json (serve --refit); "
        "vllm:table, vllm:k=K (vLLM's own server on the pair, our table exported; bash bench/vllm/setup.sh "
        "first)."))] = "table,k=0",
    rates: Annotated[str, typer.Option("--rates", help="Arrival rates, requests/s, comma list.")] = "1,2,4",
    cvs: Annotated[str, typer.Option("--cvs", help="Coefficients of variation of the Gamma gaps (1 = Poisson).")] = "1",
    requests: Annotated[int, typer.Option("--requests", help="Requests per (policy, rate, CV).")] = 100,
    max_duration_s: Annotated[float, typer.Option(
        "--max-duration-s", help="Bound on each run; later arrivals are not sent.")] = 120.0,
    max_tokens: Annotated[str, typer.Option(
        "--max-tokens", help="MIN-MAX new tokens per request (uniform).")] = "64-128",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    slo_ttft_ms: Annotated[Optional[float], typer.Option("--slo-ttft-ms")] = None,
    slo_tpot_ms: Annotated[Optional[float], typer.Option("--slo-tpot-ms")] = None,
    slo_e2e_ms: Annotated[Optional[float], typer.Option("--slo-e2e-ms")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(
        "--prompts-file", help="Default: the bundled held-out prompts.")] = None,
    out: Annotated[Path, typer.Option("--out")] = Path("specbatch-loadtest"),
    in_process: Annotated[bool, typer.Option(
        "--in-process", help="Also replay each trace on the engine in this process (HTTP overhead).")] = False,
    check_greedy: Annotated[bool, typer.Option(
        "--check-greedy", help="Compare every response with its solo greedy output.")] = False,
    adversarial: Annotated[float, typer.Option(
        "--adversarial", help="Share of the arrivals sent as hostile requests (NaN or tiny temperatures, huge "
                              "bodies and prompts, bad JSON, clients that hang up...), each judged by the answer "
                              "the server must give; the figures are the well-formed requests'.")] = 0.0,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    table: Annotated[Optional[Path], typer.Option(
        "--table", help="Table for the 'table' policy (default: the server's quick profile).")] = None,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size")] = 32,
    threads: Annotated[int, typer.Option("--threads", help="torch threads of each server.")] = 1,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Quick-profile file the servers share.")] = None,
    force: ReplaceOpt = False,
):
    """Open-loop load test: the same Poisson/Gamma arrival trace against a server per policy (loopback)."""
    from specbatch.perfmodel.jsonio import check_replace_in
    from specbatch.serve.loadtest import OUTPUT_KINDS, LoadtestConfig, run_loadtest
    from specbatch.serve.loadtest_report import Slo, failed_runs, render_runs
    from specbatch.serve.loadtest_servers import LoadtestError

    low, _, high = max_tokens.partition("-")
    if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
        raise UsageError(f"--max-tokens {max_tokens!r}: expected MIN-MAX, e.g. 64-128")
    try:
        rates_per_s, cv_values = tuple(float(x) for x in rates.split(",")), tuple(float(x) for x in cvs.split(","))
    except ValueError:
        raise UsageError(f"--rates {rates!r} / --cvs {cvs!r}: expected comma lists of numbers") from None
    server_args = ["--max-batch-size", str(max_batch_size), "--threads", str(threads)]
    for flag, value in (("--target", target), ("--draft", draft), ("--table", table), ("--profile", profile)):
        if value is not None:
            server_args += [flag, str(value)]
    vllm_draft = None if (named := default_draft(target, draft)) is None else Path(named)
    config = LoadtestConfig(
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        rates_per_s=rates_per_s, cvs=cv_values,
        requests=requests, max_duration_s=max_duration_s, max_tokens=(int(low), int(high)), seed=seed,
        slo=Slo(slo_ttft_ms, slo_tpot_ms, slo_e2e_ms),
        prompts=tuple(read_prompts_file(prompts_file or DEMO_PROMPTS)), server_args=tuple(server_args),
        in_process=in_process, check_greedy=check_greedy, adversarial_share=adversarial,
        vllm_target=Path(target) if target else DEMO_TARGET, vllm_draft=vllm_draft,
        vllm_table=table, vllm_max_num_seqs=max_batch_size)
    check_replace_in(out, OUTPUT_KINDS, force, "--out")
    report = run_loadtest(config, out)
    render_runs(report["runs"])
    for note in report["notes"]:
        typer.echo(f"note: {note}")
    typer.echo(f"wrote {out / 'loadtest.json'}, {out / 'loadtest.csv'} and {out / 'latency.png'}")
    if failed := failed_runs(report["runs"]):
        raise LoadtestError(f"{failed[0]}; the servers' logs are in {out}" if len(failed) == 1 else
                            f"{len(failed)} runs had no successful request, first: {failed[0]}; logs in {out}")
