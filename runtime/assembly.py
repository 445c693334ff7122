"""Wiring the runtime from what a user names: the model pair, the policy, the n-gram second stage.

Commands (`cli.py`) and the demo call these functions; each returns runtime objects and raises a
one-line `SpecbatchError` for bad input. torch is imported inside the functions, so importing this
module (for its default paths) stays cheap.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specbatch.perfmodel.errors import UsageError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEMO_TARGET = DATA_DIR / "models" / "demo-target"
DEMO_DRAFT = DATA_DIR / "models" / "demo-draft"
DEMO_HEAD = DATA_DIR / "models" / "demo-head"  # an EAGLE-3 head for the demo target (data/train_demo_head.py)
DEMO_NGRAM = DATA_DIR / "models" / "demo-ngram.safetensors"
DEMO_PROMPTS = DATA_DIR / "prompts" / "heldout.jsonl"
LOW_ACCEPTANCE_PROMPTS = DATA_DIR / "prompts" / "base64.jsonl"  # data/make_base64_prompts.py: the draft agrees less
MAX_SEED = 2**63 - 1  # a seed is a signed 64-bit integer (torch's generators take it, and bench's seed + round)


def check_seed(seed: int, option: str = "--seed") -> None:
    if not 0 <= seed <= MAX_SEED:
        raise UsageError(f"{option} must be an integer in [0, {MAX_SEED}], got {seed}")


DEFAULT_K_WITH_DRAFT = 4  # generate's k when neither --k, --table nor --tree is given


def default_draft(target: str | None, draft: str | None) -> str | None:
    """The one --draft default (console.options.DraftOpt states it): the draft given; else the bundled demo
    draft when the target is the demo target (or none is given); else no draft."""
    if draft:
        return draft
    if target is None or Path(target).resolve() == DEMO_TARGET.resolve():
        return str(DEMO_DRAFT)
    return None


def required_draft(target: str | None, draft: str | None, command: str) -> str:
    """`default_draft` for a command that cannot run without a draft: none is a one-line error."""
    chosen = default_draft(target, draft)
    if chosen is None:
        raise UsageError(f"--draft: {command} needs a draft model or a head, and --target {target} has none by "
                         "default (the demo draft goes with the demo target only); give --draft DIR")
    return chosen


def demo_or_named(target: str | None, draft: str | None, need_draft: bool = True) -> tuple[str, str | None]:
    """What --target/--draft name (`default_draft`); no draft for a command that needs none (`need_draft`)."""
    return target or str(DEMO_TARGET), default_draft(target, draft) if need_draft else None


def load_named_pair(target: str | None, draft: str | None, device: str | None, dtype: str | None,
                    need_draft: bool = True, check=None, text: bool = False):
    """`runtime.loading.load_pair` for what --target/--draft/--device/--dtype name (`demo_or_named`);
    `check(draft_spec)` runs before anything is loaded. `text`: the prompts are text, so a target without a
    tokenizer.json (a preset, a config.json) is refused before its weights are built."""
    from .checkpoint import parse_dtype
    from .loading import load_pair, resolve_device, resolve_pair

    target_spec, draft_spec = resolve_pair(*demo_or_named(target, draft, need_draft))
    if text and (target_spec.directory is None or not (target_spec.directory / "tokenizer.json").is_file()):
        raise UsageError(f"--target {target_spec.source}: no tokenizer.json, cannot encode text prompts")
    if check is not None:
        check(draft_spec)
    device = resolve_device(device)
    return load_pair(target_spec, draft_spec, device, parse_dtype(dtype, device))


def check_head_stage2(draft_spec, stage2: Path | None = None) -> None:
    """--stage2 (the n-gram that speeds up a draft model's own drafting) is refused in one line when
    `draft_spec` is a head, which drafts its chains and trees without it (runtime/drafters/head.py)."""
    from specbatch.perfmodel.table import drafter_phrase

    if draft_spec is None or draft_spec.head is None or stage2 is None:
        return
    raise UsageError(f"--stage2 {stage2}: a head drafts without the n-gram second stage (which speeds up a draft "
                     f"model's own drafting), and --draft {draft_spec.source} is "
                     f"{drafter_phrase(draft_spec.drafter)}; leave --stage2 out")


def check_stage2_file(path: Path, expected_sha256: str, what: str) -> None:
    """The one sha256 check of an n-gram file against the one a table or model was computed with."""
    from specbatch.perfmodel.jsonio import file_sha256

    digest = file_sha256(Path(path))
    if digest != expected_sha256:
        raise UsageError(f"--stage2 {path}: not the n-gram file {what} (sha256 {digest[:12]}, "
                         f"expected {expected_sha256[:12]})")


def strategy_policy(tree: str, stage2: Path | None, model_file: Path | None, max_batch: int):
    """The policy for --tree SPEC (the same tree every step) or --tree auto: the strategy the performance
    model in `model_file` predicts best at each batch size up to `max_batch` (trees and chains, and with
    the second stage when --stage2 is given), computed here as an in-memory table."""
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.policy import FixedStrategy, TableK

    if tree != "auto":
        return FixedStrategy(Strategy(parse_tree(tree), stage2=stage2 is not None))
    if model_file is None:
        raise UsageError("--tree auto needs --model FILE (a specbatch.model/1 file from `specbatch fit`)")
    from specbatch.perfmodel.model import choose_acceptance, compute_table, load_model

    fitted = load_model(model_file)
    if stage2 is not None and fitted.stage2 is None:
        raise UsageError(f"--stage2 with --tree auto: {model_file} has no second-stage measurements; "
                         "calibrate with --stage2 first")
    table = compute_table(fitted, choose_acceptance(fitted, None, str(model_file)), max_batch,
                          strategies="all" if stage2 is not None else "tree")
    return TableK(table)


def check_made_for(what: str, made_for: dict, running: dict, force: bool = False) -> None:
    """Refuse a table or model computed for another pair: its k was chosen for other models' speed and
    acceptance, so it runs but silently picks wrong (an OPT table on the demo pair says k = 0). Both dicts
    map role -> (source, fingerprint), and "drafter" -> what drafts (perfmodel.table.DRAFTERS); roles,
    fingerprints or drafters missing on either side (older files, an n-gram draft) are not compared. `force`
    runs anyway, except for another kind of drafter: a head's step (its passes) is not a draft model's, so
    the file's strategies and costs describe another runtime."""
    from specbatch.perfmodel.table import drafter_phrase

    made, now = made_for.get("drafter"), running.get("drafter")
    if made and now and made != now:
        there, here = made_for.get("draft", (None,))[0], running.get("draft", (None,))[0]
        raise UsageError(f"{what} was made for {drafter_phrase(made)} ({there}), and --draft {here} is "
                         f"{drafter_phrase(now)}: its strategies and step costs are another drafter's (--force does "
                         "not apply); calibrate and fit with this --draft")
    differences = []
    for role, (source, fingerprint) in ((r, v) for r, v in made_for.items() if r != "drafter"):
        now_source, now_fingerprint = running.get(role, (None, None))
        if fingerprint and now_fingerprint and fingerprint != now_fingerprint:
            differences.append(f"{role} {source} ({fingerprint[:12]}) there, {now_source} ({now_fingerprint[:12]}) "
                               "here")
    if differences and not force:
        raise UsageError(f"{what} was made for another pair: {'; '.join(differences)}; pass --force to use it anyway")


def table_made_for(table) -> dict:
    """What `check_made_for` needs from a perfmodel.table.Table."""
    fingerprints = table.fingerprints or {}
    return {**{role: (getattr(table, role), fingerprints.get(role)) for role in ("target", "draft")},
            "drafter": table.drafter}


def files_for_pair(table: Path | None, model: Path | None, stage2: Path | None, running: dict,
                   force: bool = False, adaptive: Path | None = None) -> Path | None:
    """`bench`: --table and --model must be made for the `running` pair (see `check_made_for`), and a table
    whose entries use the second stage brings its own n-gram file when --stage2 is not given. Returns the
    n-gram file to use (None: none)."""
    from specbatch.perfmodel.model import load_model
    from specbatch.perfmodel.table import load_table

    from .loading import model_made_for

    for option, path in (("--model", model), ("--adaptive", adaptive)):
        if path is not None:
            check_made_for(f"{option} {path}", model_made_for(load_model(path)), running, force)
    if table is not None:
        loaded = load_table(table)
        check_made_for(f"--table {table}", table_made_for(loaded), running, force)
        staged = any(entry.chosen().stage2 for bucket in loaded.buckets for entry in bucket.entries)
        if stage2 is None and staged:
            return recorded_stage2(loaded.stage2, f"--table {table}")
    return stage2


def recorded_stage2(recorded: dict | None, what: str) -> Path:
    """The n-gram file a table names ({"file", "sha256"}): its recorded path while that file's sha256 still
    matches, else the bundled n-gram when it is that file (older tables recorded a path relative to the
    directory they were made in)."""
    from specbatch.perfmodel.jsonio import file_sha256

    if not recorded:
        raise UsageError(f"{what} uses the n-gram second stage but names no n-gram file; pass --stage2 FILE")
    named = Path(recorded["file"])
    for candidate in (named, DEMO_NGRAM):
        if candidate.is_file() and file_sha256(candidate) == recorded["sha256"]:
            return candidate
    raise UsageError(f"{what} uses the n-gram second stage {named} (sha256 {recorded['sha256'][:12]}), which is "
                     "missing or has changed since; pass --stage2 FILE")


def second_stage_for(policy, stage2: Path | None, target):
    """The n-gram model a policy needs: --stage2, else the file a table (or the adaptive policy's model)
    names (checked by sha256). `target`: the target's runtime.loading.ModelSpec."""
    from .loading import load_ngram

    table = getattr(policy, "table", None)
    record = table.stage2 if table is not None else getattr(policy, "stage2_record", None)
    if stage2 is None and getattr(policy, "needs_stage2", False):
        stage2 = recorded_stage2(record, policy.describe())
    if stage2 is None:
        return None
    if record and getattr(policy, "needs_stage2", False):
        check_stage2_file(stage2, record["sha256"], "the table or model was computed for")
    return load_ngram(stage2, "--stage2", target)


def adaptive_for_pair(model_file: Path, running: dict, force: bool, mode: str = "greedy", staged: bool = True,
                      refit: bool = False):
    """`--adaptive MODEL.json`: the adaptive policy (runtime.adaptive) from a model made for the `running`
    pair (`check_made_for`); its second-stage chains only when the model measured the second stage; `refit`
    (--refit): its step costs re-fitted from the steps it runs (runtime.refit)."""
    from specbatch.perfmodel.model import load_model
    from specbatch.runtime.adaptive import adaptive_policy

    from .loading import model_made_for

    if not Path(model_file).is_file():
        raise UsageError(f"--adaptive {model_file}: no such file")
    # before the policy is built: what it says about the model's noise is for a model it will run
    check_made_for(f"--adaptive {model_file}", model_made_for(load_model(model_file)), running, force)
    return adaptive_policy(Path(model_file), staged=staged, mode=mode, refit=refit)


@dataclass(frozen=True)
class GenerationRequest:
    """What `specbatch generate` (and the demo) asks for; validated before any model is loaded."""

    prompts: tuple[str, ...]
    target: str | None = None
    draft: str | None = None  # a model directory, a head (runtime.heads), or an n-gram .safetensors file (alone)
    k: int | None = None
    table: Path | None = None
    tree: str | None = None
    stage2: Path | None = None
    model: Path | None = None  # for --tree auto
    adaptive: Path | None = None  # a specbatch.model/1 file: the adaptive policy (runtime.adaptive)
    refit: bool = False  # the adaptive policy re-fits its step costs from the steps it runs (runtime.refit)
    force: bool = False  # use a table or model made for another pair
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    cuda_graphs: bool | None = None  # None: the device's default (runtime.cuda_graphs); False: --eager

    def __post_init__(self):
        if self.k is not None and self.k < 0:
            raise UsageError(f"--k must be >= 0, got {self.k}")
        if sum(x is not None for x in (self.k, self.table, self.tree, self.adaptive)) > 1:
            raise UsageError("--k, --table, --tree and --adaptive are mutually exclusive")
        if self.adaptive is not None and not self.adaptive.is_file():
            raise UsageError(f"--adaptive {self.adaptive}: no such file")
        if self.refit and self.adaptive is None:
            raise UsageError("--refit re-fits the adaptive policy's step costs: it needs --adaptive MODEL.json")
        if not self.prompts:
            raise UsageError("give at least one --prompt or a --prompts-file")
        if self.max_new_tokens <= 0:  # checked here, before a model is loaded
            raise UsageError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        check_seed(self.seed)
        for number, text in enumerate(self.prompts, start=1):
            if text == "":  # the same rule as the server's: a model continues text, and there is none
                raise UsageError(f"prompt {number} of {len(self.prompts)} is empty: give text for the model to "
                                 "continue")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:  # a command-line argument with bytes that are not UTF-8
                raise UsageError(f"--prompt {text!r}: not UTF-8 text ({error.reason} at character "
                                 f"{error.start}); give prompts as UTF-8") from None
        if self.model is not None and self.tree != "auto":  # it would be ignored without a word
            raise UsageError("--model is read only with --tree auto (the strategy it predicts best per batch size)")
        if self.model is not None and not self.model.is_file():
            raise UsageError(f"--model {self.model}: no such file")
        if self.table is not None and not self.table.is_file():
            raise UsageError(f"--table {self.table}: no such file")
        if self.stage2 is not None and self.tree is None and self.table is None:
            raise UsageError("--stage2 needs --tree or --table (a chain is --tree chain:K)")


@dataclass
class Generation:
    outputs: list[dict[str, Any]]  # {"prompt", "text", "token_ids"} per prompt
    stats: Any  # runtime.generator.GenerationStats
    policy: str
    sampling: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"outputs": self.outputs, "stats": self.stats.to_dict(), "policy": self.policy,
                "sampling": self.sampling}


def generate_texts(request: GenerationRequest, loaded_pair=None) -> Generation:
    """Encode the prompts, build the policy and second stage, generate in one batch, decode.
    `loaded_pair` (a runtime.loading.LoadedPair) reuses models already loaded (the demo)."""
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.loading import is_ngram_file, load_ngram
    from specbatch.runtime.policy import FixedK, TableK
    from specbatch.runtime.sampling import Sampling

    sampling = Sampling(temperature=request.temperature, top_k=request.top_k, top_p=request.top_p)
    ngram_draft = is_ngram_file(request.draft)
    if ngram_draft and request.stage2 is not None:
        raise UsageError("--stage2 speeds up a draft MODEL; with an n-gram --draft there is nothing to stage")
    pair = loaded_pair or load_named_pair(request.target, None if ngram_draft else request.draft, request.device,
                                          request.dtype, need_draft=request.k != 0 and not ngram_draft,
                                          check=lambda spec: check_head_stage2(spec, request.stage2), text=True)
    if pair.tokenizer is None:
        raise UsageError(f"--target {pair.target_spec.source}: no tokenizer.json, cannot encode text prompts")
    draft_runner = load_ngram(request.draft, "--draft", pair.target_spec) if ngram_draft else pair.draft
    running = pair.running()
    if request.adaptive is not None:
        policy = adaptive_for_pair(request.adaptive, running, request.force,
                                   "greedy" if sampling.greedy else "sampling", refit=request.refit)
    elif request.tree is not None:
        policy = strategy_policy(request.tree, request.stage2, request.model, len(request.prompts))
    elif request.table is not None:
        policy = TableK(request.table)
    else:
        policy = FixedK(request.k if request.k is not None else (DEFAULT_K_WITH_DRAFT if draft_runner else 0))
    table = getattr(policy, "table", None)
    if table is not None:
        what = f"--table {request.table}" if request.table is not None else f"--model {request.model}"
        check_made_for(what, table_made_for(table), running, request.force)
    second_stage = second_stage_for(policy, request.stage2, pair.target_spec)
    if draft_runner is None and policy.max_k > 0:
        raise UsageError("k > 0 needs a draft model (--draft)")
    encoded = [pair.tokenizer.encode(text) for text in request.prompts]
    vocab = pair.target.config.vocab_size
    if outside := sorted({t for ids in encoded for t in ids if not 0 <= t < vocab}):
        raise UsageError(f"{tokenizer_past_vocabulary(pair.target_spec.source, outside[0], vocab)}; a prompt uses "
                         "that token")
    generator = SpeculativeGenerator(pair.target, draft_runner, pair.eos_token_ids, stage2=second_stage,
                                     cuda_graphs=request.cuda_graphs)
    result = generator.generate(encoded, request.max_new_tokens, policy, sampling, request.seed)
    decode = pair.tokenizer.decode
    outputs = [{"prompt": text, "text": decode(ids), "token_ids": ids}
               for text, ids in zip(request.prompts, result.token_ids)]
    return Generation(outputs, result.stats, policy.describe(), sampling.describe())


def generations_jsonl(generation: Generation) -> str:
    return "".join(json.dumps(output) + "\n" for output in generation.outputs)


def tokenizer_past_vocabulary(target_source: str, token_id: int, vocab: int) -> str:
    """Why a tokenizer's id past the model's vocabulary cannot run, as generate (a prompt that uses it) and serve
    (at start: its prompts may) say it."""
    return (f"--target {target_source}: its tokenizer gives token id {token_id} (an added token?) but the model's "
            f"vocabulary has {vocab} tokens")
