"""`specbatch serve`: load the pair, choose the policy, build the engine and run uvicorn.

The policy: --table FILE, --k K, --tree SPEC, or (none of them) a chain table computed at start-up from
a quick calibration profile of this machine (`calibrate --quick`), cached under --profile or in the user
cache directory so the next start reuses it. Which one runs is logged.

Shutdown: SIGINT/SIGTERM stop new requests (503, the port stays open meanwhile), give in-flight ones
`drain_s` seconds, then cancel what is left with a final event (streams end with a finish_reason and
[DONE]); uvicorn then closes and the process exits 0. A second SIGINT quits at once.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path

from specbatch.perfmodel.errors import SpecbatchError
from specbatch.runtime.assembly import DEMO_PROMPTS, DEMO_TARGET, default_draft

log = logging.getLogger("specbatch.serve")



class ServeError(SpecbatchError):
    """Options `serve` cannot use."""


@dataclass(frozen=True)
class ServeOptions:
    target: str | None = None  # None: the bundled demo pair
    draft: str | None = None
    table: Path | None = None
    k: int | None = None
    tree: str | None = None
    adaptive: Path | None = None  # a specbatch.model/1 file: the adaptive policy (runtime.adaptive)
    refit: bool = False  # the adaptive policy re-fits its step costs from the served steps (runtime.refit)
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 32
    kv_budget_tokens: int | None = None
    max_model_len: int | None = None  # prompt + max_tokens of one request; sizes every KV slot (None: the models')
    kv_cache_gb: float | None = None  # GiB both models' KV slots may take (None: a share of the free memory)
    cuda_graphs: bool | None = None  # passes replay CUDA graphs: None, the device's default; False: --eager
    allow_mode_mismatch: bool = False  # a table or model of eager costs for graphed passes (or the reverse)
    max_waiting: int = 1024
    max_tokens_limit: int = 1024  # the largest max_tokens a request may ask for
    device: str | None = None
    dtype: str | None = None
    profile: Path | None = None  # the quick profile's file (default: in the user cache directory)
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    model_name: str | None = None  # what clients send as "model" (default: the target directory's name)
    drain_s: float = 30.0
    force: bool = False  # serve a --table or --adaptive model made for another pair anyway


def check_options(options: ServeOptions) -> None:
    """What can be checked before a model loads or a quick profile is measured (a minute on a CPU)."""
    from specbatch.perfmodel.jsonio import writable_path

    if not 0 <= options.port <= 65535:
        raise ServeError(f"--port must be in [0, 65535], got {options.port}")
    for option, value, minimum in (("--max-batch-size", options.max_batch_size, 1),
                                   ("--max-tokens-limit", options.max_tokens_limit, 1),
                                   ("--max-waiting", options.max_waiting, 0),
                                   ("--kv-budget-tokens", options.kv_budget_tokens, 1),
                                   ("--threads", options.threads, 1)):
        if value is not None and value < minimum:
            raise ServeError(f"{option} must be >= {minimum}, got {value}")
    if options.max_model_len is not None and options.max_model_len < 2:
        raise ServeError(f"--max-model-len must be >= 2 (a prompt token and a generated one) and below the models' "
                         f"context, got {options.max_model_len}")
    if not options.drain_s >= 0:  # also refuses nan
        raise ServeError(f"--drain-s must be >= 0 seconds, got {options.drain_s}")
    if options.profile is not None and not options.profile.is_file():
        writable_path(options.profile, "--profile")  # the quick profile is measured into it


def check_address(host: str, port: int) -> None:
    """--host and --port can be bound here, checked before the models load (uvicorn would find out only after,
    in its own words): an address that is no address, a name that does not resolve, an address of another
    machine, a port in use."""
    import errno
    import ipaddress
    import socket

    if host.replace(".", "").isdigit() or ":" in host:  # spelled as an address: it must be one
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ServeError(f"--host {host}: not an IP address (IPv4: four numbers in [0, 255] like "
                             "127.0.0.1; IPv6: like ::1)") from None
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        reason = error.strerror if isinstance(error, socket.gaierror) else str(error)
        raise ServeError(f"--host {host}: not an address or a name this machine resolves ({reason})") from None
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closing socket is no owner
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ServeError(f"--port {port}: already in use on {host} (another server?); give a free port"
                                 ) from None
            raise ServeError(f"--host {host}: cannot be bound here ({error.strerror}); give an address of this "
                             "machine, or 0.0.0.0 for all of them") from None


def default_profile_path(target: Path, draft: Path, device: str, dtype: str, threads: int) -> Path:
    """A cache file per (pair, device, dtype, threads, torch version): timings depend on all of them."""
    import torch

    key = "|".join([str(target.resolve()), str(draft.resolve()), device, dtype, str(threads), torch.__version__])
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specbatch"
    return root / f"quick-profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def quick_table(target: Path, draft: Path, device: str, dtype: str | None, threads: int, max_batch: int,
                profile: Path | None):
    """A chain table for b = 1..max_batch from a quick profile of this machine (measured once, cached)."""
    from specbatch.calibrate.run import CalibrationRequest, calibrate
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.jsonio import make_dir
    from specbatch.perfmodel.model import choose_acceptance, compute_table
    from specbatch.perfmodel.profile import load_profile
    from specbatch.runtime.checkpoint import parse_dtype

    dtype_label = str(parse_dtype(dtype, device)).removeprefix("torch.")
    path = profile or default_profile_path(target, draft, device, dtype_label, threads)
    if path.is_file():
        log.info("no --table/--k/--tree: computing the table from the cached quick profile %s", path)
    else:
        log.info("no --table/--k/--tree: measuring a quick calibration profile of this machine into %s "
                 "(once; about a minute on a CPU), then computing the table from it", path)
        make_dir(path.parent, "--profile")
        # acceptance is measured on the bundled held-out prompts whatever the pair: generic text and code
        try:
            calibrate(CalibrationRequest(target=str(target), draft=str(draft), out=path, device=device, dtype=dtype,
                                         prompts=DEMO_PROMPTS, quick=True))
        except SpecbatchError as error:  # calibrate names its own option, --out: here the file is --profile's
            raise ServeError(str(error).replace("--out ", "--profile ", 1)) from None
    fitted = fit_profile(load_profile(path))
    return compute_table(fitted, choose_acceptance(fitted, None, str(path)), max_batch, strategies="chain")


def choose_policy(options: ServeOptions, target_dir: Path, draft_dir: Path | None, device: str, threads: int,
                  running: dict | None = None):
    """The policy the options ask for; a --table or --adaptive model made for another pair than `running`
    (role -> (source, fingerprint), runtime.loading.LoadedPair.running) is refused without --force."""
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.assembly import check_made_for, table_made_for
    from specbatch.runtime.policy import FixedK, FixedStrategy, TableK

    if sum(x is not None for x in (options.table, options.k, options.tree, options.adaptive)) > 1:
        raise ServeError("--table, --k, --tree and --adaptive are mutually exclusive")
    if options.refit and options.adaptive is None:
        raise ServeError("--refit re-fits the adaptive policy's step costs: it needs --adaptive MODEL.json")
    if running is None:
        from specbatch.perfmodel.jsonio import directory_fingerprint

        running = {role: (str(path), directory_fingerprint(path)) for role, path in
                   (("target", target_dir), ("draft", draft_dir)) if path is not None}
    if options.adaptive is not None:
        from specbatch.runtime.assembly import adaptive_for_pair

        if draft_dir is None:
            raise ServeError("--adaptive speculates: it needs a draft model (--draft DIR)")
        policy = adaptive_for_pair(options.adaptive, running, force=options.force, refit=options.refit)
    elif options.k is not None:
        if options.k < 0:
            raise ServeError(f"--k must be >= 0, got {options.k}")
        policy = FixedK(options.k)
    elif options.tree is not None:
        policy = FixedStrategy(Strategy(parse_tree(options.tree)))
    elif options.table is not None:
        if not options.table.is_file():
            raise ServeError(f"--table {options.table}: no such file")
        policy = TableK(options.table)
        check_made_for(f"--table {options.table}", table_made_for(policy.table), running, options.force)
    elif draft_dir is None:
        policy = FixedK(0)
    else:
        policy = TableK(quick_table(target_dir, draft_dir, device, options.dtype, threads, options.max_batch_size,
                                    options.profile))
    if policy.max_k > 0 and draft_dir is None:
        raise ServeError("speculation (k > 0, a tree or a table) needs a draft model: --draft DIR")
    return policy


# Without --kv-cache-gb the KV slots may take this share of the memory free after loading the models: most
# of a GPU's (nothing else should run there), half of a CPU machine's RAM (shared with everything else).
KV_SHARE_OF_FREE = {"cuda": 0.9, "cpu": 0.5}


def kv_cache_bytes(kv_cache_gb: float | None, device: str, graph_bytes: int = 0) -> int:
    """The KV cache's size in bytes: --kv-cache-gb, or a share of the device's free memory now less what the
    CUDA graphs will hold (`graph_bytes`: calibrate.memory.serving_graph_bytes). A --kv-cache-gb past what the
    memory plans may use of the free memory (calibrate.memory.HEADROOM of it, less the graphs) is refused in
    one line: the KV slots are allocated at start, and an allocation that fails is a crash, not a message."""
    from specbatch.calibrate.environment import available_memory_bytes
    from specbatch.calibrate.memory import GIB, HEADROOM

    if kv_cache_gb is not None:
        if not kv_cache_gb > 0:
            raise ServeError(f"--kv-cache-gb must be > 0, got {kv_cache_gb}")
        free = available_memory_bytes(device)
        room = int(HEADROOM * free) - graph_bytes
        if kv_cache_gb * GIB > room:
            graphs = f", less {graph_bytes / GIB:.3g} GiB for CUDA graphs" if graph_bytes else ""
            raise ServeError(f"--kv-cache-gb {kv_cache_gb:g}: {free / GIB:.3g} GiB are free on {device} after loading "
                             f"the models, and the KV cache may take {max(room, 0) / GIB:.3g} GiB of it "
                             f"({100 * HEADROOM:.0f} %{graphs}); give at most that, or leave the option out")
        return int(kv_cache_gb * GIB)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return max(0, int(KV_SHARE_OF_FREE[kind] * available_memory_bytes(device)) - graph_bytes)


def check_policy_execution(policy, options: ServeOptions, device: str, dtype) -> None:
    """A table or adaptive model whose costs were measured in the other execution mode is refused (one line)
    unless --allow-mode-mismatch; fixed strategies carry no costs."""
    from specbatch.perfmodel.execution import check_execution, table_execution
    from specbatch.runtime.devices import execution_on

    running = execution_on(device, dtype, options.cuda_graphs)
    table = getattr(policy, "table", None)
    if table is not None and options.table is not None:
        check_execution(f"--table {options.table}", table_execution(table.costs), running,
                        options.allow_mode_mismatch)
    fitted_execution = getattr(policy, "execution", None)
    if fitted_execution is not None:
        check_execution(f"--adaptive {options.adaptive}", fitted_execution, running, options.allow_mode_mismatch)


def _graph_bytes(generator, pair, policy, options: ServeOptions) -> int:
    """The CUDA graphs' memory the KV share leaves room for (0 without graphs): the target's, and a draft model's
    or a head's (its passes and the target's features it reads, calibrate.memory.generation_graph_bytes)."""
    if not generator.cuda_graphs:
        return 0
    from specbatch.calibrate.memory import serving_graph_bytes
    from specbatch.calibrate.models import model_info

    dtype = pair.target.lm_head.weight.dtype
    draft = model_info(pair.draft_spec, dtype) if pair.draft_spec is not None else None
    key_len = options.max_model_len or pair.target.config.max_position_embeddings
    return serving_graph_bytes(model_info(pair.target_spec, dtype), draft, options.max_batch_size, policy.max_k,
                               key_len)


def build(options: ServeOptions):
    """(runner, served model) ready for `create_app`; loads the models and chooses the policy."""
    import torch

    from specbatch.runtime.assembly import second_stage_for
    from specbatch.runtime.checkpoint import parse_dtype
    from specbatch.runtime.engine import Engine, EngineConfig, KVCacheTooSmall
    from specbatch.runtime.generator import SpeculativeGenerator, context_limit
    from specbatch.runtime.loading import load_pair, resolve_device, resolve_pair

    from .app import ServedModel
    from .runner import EngineRunner

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    device = resolve_device(options.device)
    target_dir = Path(options.target) if options.target else DEMO_TARGET
    draft_name = default_draft(options.target, options.draft)
    draft_dir = None if draft_name is None else Path(draft_name)
    target_spec, draft_spec = resolve_pair(str(target_dir), None if draft_dir is None else str(draft_dir))
    if target_spec.directory is None or not (target_spec.directory / "tokenizer.json").is_file():  # before loading
        raise ServeError(f"--target {target_dir}: no tokenizer.json; serve needs one to encode prompts")
    pair = load_pair(target_spec, draft_spec, device, parse_dtype(options.dtype, device))
    warn_tokenizer_past_vocabulary(pair)
    positions = context_limit(pair.target, pair.draft)
    if options.max_model_len is not None and options.max_model_len >= positions:
        raise ServeError(f"--max-model-len {options.max_model_len}: the models hold {positions} positions, and a "
                         "step needs room for its draft tokens beyond a request's; give a smaller value")
    policy = choose_policy(options, target_dir, draft_dir, device, torch.get_num_threads(), pair.running())
    stage2 = second_stage_for(policy, None, target_spec)  # a table's staged entries: the n-gram it names (by sha256)
    if options.cuda_graphs and not device.startswith("cuda"):
        raise ServeError(f"CUDA graphs need a CUDA device, got --device {device}")
    check_policy_execution(policy, options, device, pair.target.lm_head.weight.dtype)
    generator = SpeculativeGenerator(pair.target, pair.draft, pair.eos_token_ids, stage2=stage2,
                                     cuda_graphs=options.cuda_graphs)
    graphs = _graph_bytes(generator, pair, policy, options)
    config = EngineConfig(max_batch_size=options.max_batch_size, kv_budget_tokens=options.kv_budget_tokens,
                          max_waiting=options.max_waiting, max_context_tokens=options.max_model_len,
                          kv_cache_bytes=kv_cache_bytes(options.kv_cache_gb, device, graphs))
    try:
        engine = Engine(generator, policy, config, decode=pair.tokenizer.decode)
    except KVCacheTooSmall as error:
        given = "--kv-cache-gb" if options.kv_cache_gb is not None else "the free memory (set --kv-cache-gb)"
        raise ServeError(f"{given}: {error}") from None
    if generator.cuda_graphs and hasattr(policy, "cost_rows"):  # the adaptive policy: costs at the bucket run
        from specbatch.runtime.cuda_graphs import bucket_for

        capacity = engine.max_batch_size
        policy.cost_rows = lambda b: bucket_for(b, capacity)
    name = options.model_name or target_dir.name
    log.info("serving %s (draft %s) as model %r with %s; max batch %d (%d KV slots of %d tokens fit in %.3g GiB), "
             "KV budget %d tokens", target_dir, draft_dir, name, policy.describe(), engine.max_batch_size,
             engine.max_batch_size, engine.max_context_tokens, config.kv_cache_bytes / 2**30, engine.kv_budget_tokens)
    template, special_tokens = _chat_settings(target_dir)
    served = ServedModel(name, _encoder(pair.tokenizer.backend), pair.tokenizer.decode,
                         min(options.max_tokens_limit, engine.max_context_tokens - 1), template,
                         max_prompt_chars=engine.max_context_tokens * _longest_token_chars(pair.tokenizer.backend),
                         special_tokens=special_tokens, draft=draft_description(draft_spec, policy))
    return EngineRunner(engine), served


def warn_tokenizer_past_vocabulary(pair) -> None:
    """A tokenizer with ids past the model's vocabulary (added tokens the model has no row for): generate refuses
    a prompt that uses one; serve cannot know its prompts at start, so it says so in one line then, and a request
    whose text gives such an id gets a 400 that explains it."""
    from specbatch.runtime.assembly import tokenizer_past_vocabulary

    vocab = pair.target.config.vocab_size
    past = sorted(i for i in pair.tokenizer.backend.get_vocab(with_added_tokens=True).values() if i >= vocab)
    if past:
        more = f" ({len(past)} such ids, the largest {past[-1]})" if len(past) > 1 else ""
        log.warning("%s%s; a request whose text gives that token gets a 400",
                    tokenizer_past_vocabulary(str(pair.target_spec.source), past[0], vocab), more)


def draft_description(draft_spec, policy) -> dict | None:
    """What /v1/models says drafts: the draft model's or head's name (a directory's, a preset's; never the
    server's paths) and its kind (draft_model | eagle3 | mtp); None when nothing drafts."""
    if draft_spec is None or policy.max_k == 0:
        return None
    source = Path(draft_spec.source)
    name = source.name if draft_spec.directory is not None or not source.is_file() else \
        f"{source.parent.name}/{source.name}"  # a config.json (random weights): its folder says which
    return {"id": name, "kind": draft_spec.drafter}


def _encoder(backend):
    """The tokenizer's encode, through encode_batch: the same ids, and unlike encode it releases the GIL, so
    a long prompt tokenized in a worker thread leaves the event loop running."""
    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    return encode


def _longest_token_chars(backend) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level entries have
    a character per byte, so this bounds characters too), doubled for normalizers that drop characters."""
    return 2 * max(len(token) for token in backend.get_vocab(with_added_tokens=True))


def _chat_settings(directory: Path) -> tuple[str | None, dict[str, str]]:
    """tokenizer_config.json's chat template (None without one) and the special tokens templates use
    (bos_token, eos_token, ...: strings, or objects with a "content")."""
    import json

    config = directory / "tokenizer_config.json"
    try:
        settings = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return None, {}
    template = settings.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    tokens = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = settings.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return (template if isinstance(template, str) else None), tokens


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(options: ServeOptions) -> None:
    """Run until SIGINT/SIGTERM (uvicorn installs the handlers; shutdown drains, see the module doc)."""
    import uvicorn

    configure_logging()
    from .app import create_app

    check_options(options)
    check_address(options.host, options.port)
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server has no authentication; anyone who can reach it can use it", options.host)
    with notes_as_they_come():
        runner, served = build(options)
        app = create_app(runner, served)

        config = uvicorn.Config(app, host=options.host, port=options.port, log_level="info",
                                timeout_graceful_shutdown=int(options.drain_s) + 5)
        draining_server(config, runner, options.drain_s).run()


@contextlib.contextmanager
def notes_as_they_come():
    """Log each distinct note (a NoteWarning: a table's range at a request's context or batch size, raised in the
    engine's thread) when it is raised: the CLI prints the notes a command leaves at its end, and a server's
    end may be days after the request. Other warnings go where they went."""
    from specbatch.perfmodel.errors import NoteWarning

    said: set[str] = set()
    with warnings.catch_warnings():  # restores the previous handler on the way out
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, NoteWarning):
                previous(message, category, filename, lineno, file, line)
            elif str(message) not in said:
                said.add(str(message))
                log.warning("note: %s", message)

        warnings.showwarning = show
        yield


def draining_server(config, runner, drain_s: float):
    """A uvicorn.Server that drains before it closes: the first SIGINT/SIGTERM closes the engine to new
    requests (they get 503 while the port stays open) and lets in-flight ones finish for `drain_s` seconds
    (then they are cancelled); uvicorn shuts down once the engine is idle. The signal is not raised again
    after the shutdown (uvicorn's default, which exits 128 + signal): a drained server exits 0. A second
    signal shuts down now, a second SIGINT without waiting for open connections."""
    import threading
    import time

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if runner.draining:
                self.should_exit = True
                self.force_exit = sig == signal.SIGINT
                return
            runner.begin_shutdown(drain_s)
            threading.Thread(target=self._exit_when_idle, name="specbatch-drain", daemon=True).start()

        def _exit_when_idle(self) -> None:
            while not runner.idle:
                time.sleep(0.05)
            self.should_exit = True

    return Server(config)


class BackgroundServer:
    """uvicorn in a thread of this process, on a loopback port (tests, the in-process load test); it drains
    as `serve` does when `server.handle_exit(signal, None)` is called (a thread gets no signals)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_s: float = 5.0):
        import socket
        import threading

        import uvicorn

        self._socket = socket.socket()
        self._socket.bind((host, port))  # port 0: the OS picks a free one, and nobody takes it meanwhile
        self.host, self.port = host, self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = draining_server(config, app.state.runner, drain_s)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        import time

        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise ServeError("the background server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self._socket.close()
