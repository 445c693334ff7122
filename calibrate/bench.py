"""`specbatch bench`: check a table (and the performance model behind it) against real generation.

For every batch size b the harness generates from the same b prompts with plain decoding (k = 0),
every fixed k, the table policy, fixed draft trees, the same chains and trees with the n-gram second
stage and, optionally, Hugging Face `generate` as a peer, and measures generated tokens per second of
wall time (prefill, every forward pass and all bookkeeping included).

The contenders, by their stable names (bench.json, bench.csv):
  * `k=K`: a chain of K draft tokens every step (`k=0` is plain decoding, always run);
  * `table`: the strategy of the --table file at the current batch size;
  * `tree:SPEC`: the same draft tree every step (`tree:chain:K` for a chain given as a tree; a long
    spec is cut at whole paths and ends in ',...(N nodes)'); `--tree auto` becomes, before anything is
    measured, the performance model's best tree at batch size 1 (a note says which);
  * with an n-gram second stage: `k=K+ngram` for every K > 0 and `tree:SPEC+ngram` for every tree.
Each batch size's `strategy_comparison` puts the best chain (the best fixed k, k = 0 included), the
best tree and the best staged policy side by side, against plain decoding and the best chain.

How the measurement is kept honest:
  * Interleaved rounds. Each round runs every policy once; the order rotates by one between rounds
    (A B C, B C A, C A B, ...), so slow drift of a shared machine (thermal state, a background job)
    spreads over all policies instead of picking the winner. One warm-up round per batch size runs
    first and is discarded: each (policy, b) has its own tensor shapes, whose first use pays
    allocator (and, on CUDA, kernel-selection) costs that steady-state serving does not.
  * Constant batch size. EOS is ignored (the generator gets `eos_token_ids=()`) and every row asks
    for the same `max_new_tokens`, so no row leaves the batch early because its text ended. Rows
    still advance at different speeds under speculation (they accept different numbers of tokens),
    so the batch thins out in the last few steps; `full_batch_step_fraction` reports how much of a
    run really ran at b, and the table's k is read from the full-batch steps only.
  * Common random numbers. Within a round all policies use the same seed (sampling and synthetic
    acceptance draw from it); rounds use different seeds so the spread covers that randomness.

`synthetic_acceptance` (for shape presets with random weights) accepts each draft token independently
with probability α instead of comparing with the target; every forward pass still runs. Results made
that way are labelled SYNTHETIC wherever they are written.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from perfmodel.errors import PerfModelError, SpecbatchError
from perfmodel.jsonio import write_bytes_atomic
from perfmodel.tree import Strategy, Tree, chain, parse_tree
from runtime.generator import GenerationError, SpeculativeGenerator
from runtime.model import CausalLM
from runtime.policy import FixedK, FixedStrategy
from runtime.sampling import Sampling

from .environment import device_name

BENCH_SCHEMA = "specbatch.bench/1"
TABLE_POLICY = "table"
HF_GREEDY = "hf-greedy"
HF_ASSISTED = "hf-assisted"
TREE_AUTO = "auto"  # --tree auto: the performance model's best tree at batch size 1
TREE_PREFIX = "tree:"
STAGED_SUFFIX = "+ngram"  # the n-gram second stage speeds up the draft's own drafting
TREE_NAME_SPEC_CHARS = 40  # longer tree specs are cut at whole paths in policy names
COMPARISON_KEYS = ("best_chain", "best_tree", "best_staged")
# old columns first, in their old order: readers by position keep working
CSV_COLUMNS = ("batch_size", "policy", "k", "median_tokens_per_s", "p10_tokens_per_s", "p90_tokens_per_s",
               "rounds", "acceptance", "median_steady_tokens_per_s", "predicted_tokens_per_s",
               "synthetic_acceptance", "strategy")


class BenchError(SpecbatchError):
    """A bench configuration that cannot run; the message is one line naming the option."""


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class BenchConfig:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # the Su et al. grid
    ks: tuple[int, ...] = tuple(range(9))  # fixed k to compare; k = 0 (plain decoding) is always run
    max_new_tokens: int = 64  # per row; the same for every row so the batch stays full
    rounds: int = 5  # timed rounds per batch size: enough for a median and a p10-p90 band
    warmup_rounds: int = 1  # discarded rounds per batch size (first use of every shape)
    sampling: Sampling = Sampling()
    synthetic_acceptance: float | None = None  # α in (0, 1]: benchmark-only fake verification
    seed: int = 0
    table_path: Path | None = None  # specbatch.table/1: adds the "table" policy
    model_path: Path | None = None  # specbatch.model/1: adds predicted tokens/s (and resolves --tree auto)
    peers: bool = False  # also time Hugging Face generate (plain, and assisted at b = 1)
    trees: tuple[str, ...] = ()  # parse_tree specs ("0,1,0.0", "chain:8") or "auto": adds tree:SPEC policies
    stage2_path: Path | None = None  # specbatch.ngram/1 file (loaded into BenchModels.stage2): adds +ngram policies

    def __post_init__(self):
        check_config(self)

    @property
    def fixed_ks(self) -> tuple[int, ...]:
        """The fixed k values run, ascending, k = 0 included."""
        return tuple(sorted(set(self.ks) | {0}))


def check_config(config: BenchConfig) -> None:
    """Refuse settings the harness cannot measure meaningfully; one-line messages naming the option."""
    if not config.batch_sizes:
        raise BenchError("--batch-sizes: give at least one batch size")
    if any(b <= 0 for b in config.batch_sizes):
        raise BenchError(f"--batch-sizes: every batch size must be positive, got {list(config.batch_sizes)}")
    if not config.ks:
        raise BenchError("--ks: give at least one k (e.g. 0,1,2,4)")
    if any(k < 0 for k in config.ks):
        raise BenchError(f"--ks: every k must be >= 0, got {list(config.ks)}")
    if config.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {config.max_new_tokens}")
    if config.rounds <= 0:
        raise BenchError(f"--rounds must be positive, got {config.rounds}")
    if config.warmup_rounds < 0:
        raise BenchError(f"warm-up rounds must be >= 0, got {config.warmup_rounds}")
    alpha = config.synthetic_acceptance
    if alpha is not None and not 0.0 < alpha <= 1.0:
        raise BenchError(f"--synthetic-acceptance must be in (0, 1], got {alpha}")
    if alpha is not None and config.peers:
        raise BenchError("--peers cannot be combined with --synthetic-acceptance: transformers verifies for real, "
                         "so the ratio would compare a fake acceptance with a real one")
    for spec in config.trees:
        if spec.strip() != TREE_AUTO:
            tree_from_spec(spec)
    if alpha is not None and (config.trees or config.stage2_path is not None):
        option = "--tree" if config.trees else "--stage2"
        raise BenchError(f"{option} cannot be combined with --synthetic-acceptance: the runtime fakes acceptance "
                         "for plain chains only")
    if any(spec.strip() == TREE_AUTO for spec in config.trees) and config.model_path is None:
        raise BenchError("--tree auto needs --model FILE (a specbatch.model/1 file from `specbatch fit`)")


def tree_from_spec(spec: str) -> Tree:
    """A --tree spec as `parse_tree` reads it; a bad one is a one-line BenchError naming the path."""
    try:
        return parse_tree(spec, "--tree")
    except PerfModelError as error:
        raise BenchError(str(error)) from None


def parse_sampling(text: str) -> Sampling:
    """'greedy' | 'T=0.8' | 'T=0.8,top_k=50,top_p=0.9' (the form Sampling.describe() prints).

    >>> parse_sampling("T=0.8,top_p=0.9")
    Sampling(temperature=0.8, top_k=0, top_p=0.9)
    """
    if text.strip() == "greedy":
        return Sampling()
    fields: dict[str, float] = {}
    names = {"T": "temperature", "top_k": "top_k", "top_p": "top_p"}
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key not in names or not value:
            raise BenchError(f"--sampling {text!r}: expected greedy or T=<temperature>[,top_k=<int>][,top_p=<p>]")
        try:
            fields[names[key]] = int(value) if key == "top_k" else float(value)
        except ValueError:
            raise BenchError(f"--sampling {text!r}: {key}={value!r} is not a number") from None
    if not 0.0 < fields.get("temperature", 0.0) < math.inf:
        raise BenchError(f"--sampling {text!r}: give T > 0 (or 'greedy')")
    try:
        return Sampling(**fields)
    except ValueError as error:
        raise BenchError(f"--sampling {text!r}: {error}") from None


def synthetic_label(alpha: float | None) -> str | None:
    """The label every output carries when acceptance was faked."""
    return None if alpha is None else f"SYNTHETIC acceptance α={alpha:g} (each draft token accepted with " \
                                      f"probability α; every forward pass ran)"


@dataclass
class BenchModels:
    """The pair under test, with where it came from (recorded in bench.json)."""

    target: CausalLM
    draft: CausalLM | None
    target_source: str  # directory, preset name or config.json path
    draft_source: str | None
    target_dir: Path | None = None  # Hugging Face directories: --peers loads them with transformers
    draft_dir: Path | None = None
    random_weights: bool = False  # shape presets / bare configs
    stage2: Any | None = None  # runtime.ngram.NGramModel for the +ngram policies (the CLI loads and checks it)


# ---------------------------------------------------------------------------------------------- results
@dataclass
class RunRecord:
    """One timed generation, in the order it ran."""

    batch_size: int
    round: int  # warm-up rounds are negative: -warmup_rounds .. -1
    policy: str
    generated_tokens: int
    seconds: float
    steps: int = 0
    full_batch_steps: int = 0  # steps that ran with all batch_size rows
    accepted_per_position: list[int] = field(default_factory=list)
    trials_per_position: list[int] = field(default_factory=list)
    k_counts_full_batch: dict[int, int] = field(default_factory=dict)  # k -> steps, full-batch steps only
    nodes_counts_full_batch: dict[int, int] = field(default_factory=dict)  # draft tokens per row -> steps, ditto
    # tokens / seconds over the steps that ran with the full batch (no prefill, no thinning tail):
    # the steady state the performance model's G(b, k) describes; None for peers
    steady_tokens_per_s: float | None = None

    @property
    def warmup(self) -> bool:
        return self.round < 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PolicyResult:
    policy: str  # "k=3", "table", "tree:0,1,0.0", "k=3+ngram", "tree:0,1,0.0+ngram", "hf-greedy", "hf-assisted"
    k: int | None  # fixed k or a tree's depth; the table's most frequent k at full batch; None for peers
    tokens_per_s: list[float]  # one per timed round, in round order
    median_tokens_per_s: float
    p10_tokens_per_s: float
    p90_tokens_per_s: float
    min_tokens_per_s: float
    max_tokens_per_s: float
    acceptance: float | None  # accepted / proposed draft tokens, pooled over positions and rounds
    acceptance_per_position: list[float]  # P(draft token i accepted | tokens 1..i-1 were)
    trials_per_position: list[int]  # how many draft tokens i were proposed: each rate's sample size
    full_batch_step_fraction: float | None  # None for peers: generate() does not report its steps
    median_steady_tokens_per_s: float | None = None  # full-batch steps only: compare with predictions
    p10_steady_tokens_per_s: float | None = None
    p90_steady_tokens_per_s: float | None = None
    predicted_tokens_per_s: float | None = None
    # what ran (Strategy.describe(): "none", "chain k=3", "tree 0,1,0.0 (3 nodes) +ngram"); the table's
    # strategy at this batch size and the run's mean context; None for peers
    strategy: str | None = None
    nodes: int | None = None  # draft tokens verified per row per step (most frequent at full batch); None for peers

    @property
    def rounds(self) -> int:
        return len(self.tokens_per_s)


@dataclass
class PeerRatio:
    ours: str
    theirs: str
    ratio: float  # ours / theirs, medians of the same rounds


@dataclass
class BatchResult:
    batch_size: int
    context_len: int  # mean context over a run (prompt + half the new tokens): where predictions are taken
    policies: list[PolicyResult]
    best_k: int  # the best fixed k in hindsight (highest median tokens/s)
    best_tokens_per_s: float
    table_k: int | None
    table_regret: float | None  # 1 - table / best fixed k; negative when the table beat every fixed k
    table_speedup: float | None  # table / k = 0
    peer_ratios: list[PeerRatio] = field(default_factory=list)
    # best_chain | best_tree | best_staged -> {policy, strategy, steady_tokens_per_s, vs_plain, vs_best_chain}
    # or None when no such policy ran; see `strategy_comparison`
    strategy_comparison: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def policy(self, name: str) -> PolicyResult | None:
        return next((p for p in self.policies if p.policy == name), None)


@dataclass
class BenchResult:
    config: BenchConfig
    device: dict[str, Any]
    models: dict[str, Any]
    prompts: dict[str, Any]
    batches: list[BatchResult]
    runs: list[RunRecord]  # every generation, warm-ups included, in execution order
    notes: list[str]

    @property
    def synthetic(self) -> str | None:
        return synthetic_label(self.config.synthetic_acceptance)


# ---------------------------------------------------------------------------------------------- pure helpers
def fixed_policy_name(k: int, staged: bool = False) -> str:
    return f"k={k}" + (STAGED_SUFFIX if staged else "")


def tree_label(tree: Tree, max_spec_chars: int = TREE_NAME_SPEC_CHARS) -> str:
    """`chain:K` for a chain, else the spec, cut at whole paths (as Strategy.describe cuts) when long.

    >>> tree_label(parse_tree("0,1,0.0")), tree_label(chain(3))
    ('0,1,0.0', 'chain:3')
    >>> tree_label(parse_tree("0,1,2,0.0,0.1,1.0"), max_spec_chars=8)
    '0,1,2,...(6 nodes)'
    """
    if tree.is_chain:
        return f"chain:{tree.depth}"
    spec = tree.spec()
    if len(spec) <= max_spec_chars:
        return spec
    cut = spec[:max_spec_chars + 1].rfind(",")  # keep whole paths only
    return (spec[:cut] + "," if cut > 0 else "") + f"...({tree.num_nodes} nodes)"


def tree_policy_name(tree: Tree, staged: bool = False) -> str:
    return TREE_PREFIX + tree_label(tree) + (STAGED_SUFFIX if staged else "")


def policy_family(name: str) -> str:
    """What a policy name stands for: chain (k=K), tree, staged (+ngram), table or peer.

    >>> [policy_family(n) for n in ("k=0", "k=2+ngram", "tree:0,1", "tree:0,1+ngram", "table", "hf-greedy")]
    ['chain', 'staged', 'tree', 'staged', 'table', 'peer']
    """
    if name.endswith(STAGED_SUFFIX):
        return "staged"
    if name.startswith(TREE_PREFIX):
        return "tree"
    if name.startswith("k=") and name[2:].isdigit():
        return "chain"
    return "table" if name == TABLE_POLICY else "peer"


@dataclass(frozen=True)
class BenchPolicy:
    """One of our contenders: the runtime policy the generator asks, and the strategy it always gives
    (None for the table, whose strategy depends on the batch size)."""

    name: str
    policy: Any  # runtime.policy.FixedK | FixedStrategy | TableK
    strategy: Strategy | None


def bench_policies(fixed_ks: Sequence[int], table=None, trees: Sequence[Tree] = (),
                   stage2: bool = False) -> dict[str, BenchPolicy]:
    """name -> contender, in run order: k=K (ascending), table, tree:SPEC, then with a second stage
    k=K+ngram (K > 0) and tree:SPEC+ngram. Equal trees run once; names that a cut spec would make
    equal get ' #2', ' #3' ... so every name is unique.

    >>> list(bench_policies([0, 2], trees=[parse_tree("0,1")], stage2=True))
    ['k=0', 'k=2', 'tree:0,1', 'k=2+ngram', 'tree:0,1+ngram']
    """
    policies = {fixed_policy_name(k): BenchPolicy(fixed_policy_name(k), FixedK(k), Strategy.from_k(k))
                for k in fixed_ks}
    if table is not None:
        policies[TABLE_POLICY] = BenchPolicy(TABLE_POLICY, table, None)
    unique_trees = list(dict.fromkeys(trees))
    names: dict[Tree, str] = {}
    for tree in unique_trees:
        name = tree_policy_name(tree)
        suffix = 2
        while name in names.values() or name in policies:
            name, suffix = f"{tree_policy_name(tree)} #{suffix}", suffix + 1
        names[tree] = name
    staged: list[tuple[str, Strategy]] = []
    if stage2:
        staged = [(fixed_policy_name(k, staged=True), Strategy(chain(k), stage2=True)) for k in fixed_ks if k > 0]
        staged += [(names[tree] + STAGED_SUFFIX, Strategy(tree, stage2=True)) for tree in unique_trees]
    for name, strategy in [(names[tree], Strategy(tree)) for tree in unique_trees] + staged:
        policies[name] = BenchPolicy(name, FixedStrategy(strategy), strategy)
    return policies


def rotated(items: Sequence[str], shift: int) -> list[str]:
    """`items` rotated left by `shift`: round r runs policies in order rotated(policies, r).

    >>> rotated(["a", "b", "c"], 1)
    ['b', 'c', 'a']
    """
    if not items:
        return []
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def cycled_prompts(prompts: Sequence[list[int]], batch_size: int, offset: int = 0) -> list[list[int]]:
    """`batch_size` prompts from `offset` on, cycling through the list (deterministic). Each round
    takes the next slice, so a small batch size is measured on many prompts, not on one."""
    if not prompts:
        raise BenchError("no prompts to benchmark with")
    return [list(prompts[(offset + i) % len(prompts)]) for i in range(batch_size)]


# Prompt length for models without a tokenizer (presets): about the held-out demo prompts' median
# (70 bytes, one token per byte with the demo pair's byte-level tokenizer).
RANDOM_PROMPT_TOKENS = 64


def random_prompts(count: int, length_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, for models without a tokenizer (presets): the text is irrelevant to timing."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length_tokens), generator=gen).tolist()


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90 (linear interpolation), min and max of a non-empty list."""
    array = np.asarray(values, dtype=float)
    return {"median": float(np.median(array)), "p10": float(np.percentile(array, 10)),
            "p90": float(np.percentile(array, 90)), "min": float(array.min()), "max": float(array.max())}


def attended_context_len(round_prompts: Sequence[Sequence[list[int]]], max_new_tokens: int) -> int:
    """The context every row's attention pays for, averaged over a run and over rounds: the runtime's
    attention spans the longest row of the batch (shorter rows are masked, not skipped), so it is the
    longest prompt of each round plus half the generated tokens."""
    longest = [max(len(p) for p in prompts) for prompts in round_prompts]
    return round(sum(longest) / len(longest) + max_new_tokens / 2)


def pooled_acceptance(records: Sequence[RunRecord]) -> tuple[float | None, list[float], list[int]]:
    """(accepted / proposed over all positions, per-position conditional rates, trials per position)."""
    width = max((len(r.trials_per_position) for r in records), default=0)
    accepted, trials = [0] * width, [0] * width
    for record in records:
        for i, (a, t) in enumerate(zip(record.accepted_per_position, record.trials_per_position)):
            accepted[i] += a
            trials[i] += t
    proposed = sum(trials)
    per_position = [a / t if t else 0.0 for a, t in zip(accepted, trials)]
    return (sum(accepted) / proposed if proposed else None), per_position, trials


def _most_frequent(counts: Counter[int]) -> int | None:
    """The most frequent value (ties: the smaller)."""
    if not counts:
        return None
    return min(counts, key=lambda value: (-counts[value], value))


def most_frequent_k(records: Sequence[RunRecord]) -> int | None:
    """The k the table chose most often at full batch size (ties: the smaller k)."""
    counts: Counter[int] = Counter()
    for record in records:
        counts.update(record.k_counts_full_batch)
    return _most_frequent(counts)


def most_frequent_nodes(records: Sequence[RunRecord]) -> int | None:
    """Draft tokens verified per row in most full-batch steps (ties: the fewer)."""
    counts: Counter[int] = Counter()
    for record in records:
        counts.update(record.nodes_counts_full_batch)
    return _most_frequent(counts)


def summarize_policy(policy: str, k: int | None, records: Sequence[RunRecord],
                     strategy: str | None = None) -> PolicyResult:
    """Aggregate the timed rounds of one policy at one batch size; `strategy` says what ran."""
    rates = [r.tokens_per_s for r in sorted(records, key=lambda r: r.round)]
    stats = spread(rates)
    acceptance, per_position, trials = pooled_acceptance(records)
    steps = sum(r.steps for r in records)
    full_fraction = sum(r.full_batch_steps for r in records) / steps if steps else None
    steady = [r.steady_tokens_per_s for r in records if r.steady_tokens_per_s is not None]
    steady_stats = spread(steady) if steady else {"median": None, "p10": None, "p90": None}
    return PolicyResult(
        median_steady_tokens_per_s=steady_stats["median"], p10_steady_tokens_per_s=steady_stats["p10"],
        p90_steady_tokens_per_s=steady_stats["p90"],
        policy=policy, k=k, tokens_per_s=rates, median_tokens_per_s=stats["median"],
        p10_tokens_per_s=stats["p10"], p90_tokens_per_s=stats["p90"], min_tokens_per_s=stats["min"],
        max_tokens_per_s=stats["max"], acceptance=acceptance, acceptance_per_position=per_position,
        trials_per_position=trials, full_batch_step_fraction=full_fraction, strategy=strategy,
        nodes=most_frequent_nodes(records),
    )


def peer_ratios(batch: BatchResult, ours: str) -> list[PeerRatio]:
    """Ours / theirs: plain vs plain (runtime efficiency), then our speculation vs each peer."""
    pairs = [(fixed_policy_name(0), HF_GREEDY), (ours, HF_GREEDY), (ours, HF_ASSISTED)]
    ratios, seen = [], set()
    for mine, theirs in pairs:
        a, b = batch.policy(mine), batch.policy(theirs)
        if a is None or b is None or (mine, theirs) in seen or b.median_tokens_per_s <= 0:
            continue
        seen.add((mine, theirs))
        ratios.append(PeerRatio(ours=mine, theirs=theirs, ratio=a.median_tokens_per_s / b.median_tokens_per_s))
    return ratios


def compared_rate(policy: PolicyResult) -> float:
    """The figure policies are ranked by: steady-state goodput when measured, else wall tokens/s."""
    steady = policy.median_steady_tokens_per_s
    return steady if steady is not None else policy.median_tokens_per_s


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def strategy_comparison(policies: Sequence[PolicyResult], best_chain: PolicyResult,
                        plain: PolicyResult) -> dict[str, dict[str, Any] | None]:
    """The best chain (the best fixed k, k = 0 included), the best tree and the best staged policy
    (k=K+ngram or tree:SPEC+ngram) side by side, each ranked by `compared_rate` (ties: the one run
    first), with its ratio to plain decoding (k = 0) and to the best chain; None where none ran."""
    plain_rate, chain_rate = compared_rate(plain), compared_rate(best_chain)

    def entry(policy: PolicyResult | None) -> dict[str, Any] | None:
        if policy is None:
            return None
        rate = compared_rate(policy)
        return {"policy": policy.policy, "strategy": policy.strategy, "steady_tokens_per_s": rate,
                "vs_plain": _ratio(rate, plain_rate), "vs_best_chain": _ratio(rate, chain_rate)}

    def best(family: str) -> PolicyResult | None:
        members = [p for p in policies if policy_family(p.policy) == family]
        return max(members, key=compared_rate) if members else None  # max keeps the first of equals

    return dict(zip(COMPARISON_KEYS, (entry(best_chain), entry(best("tree")), entry(best("staged")))))


def summarize_batch(batch_size: int, context_len: int, policies: list[PolicyResult], fixed_ks: Sequence[int],
                    has_peers: bool) -> BatchResult:
    """Best fixed k in hindsight, the table's k, regret and speedup over k = 0, and the side-by-side
    comparison of the best chain, tree and staged policy (`strategy_comparison`).

    Compared on steady-state goodput (the full-batch steps: every draft and verify pass and the step
    overhead, without the prefill, which is the same for every k, and without the thinning tail of a
    fixed batch, which a continuously refilled server does not have); on wall-clock tokens/s where a
    run has no steady state to report."""
    by_name = {p.policy: p for p in policies}
    fixed = [by_name[fixed_policy_name(k)] for k in fixed_ks]
    best = max(fixed, key=lambda p: (compared_rate(p), -p.k))  # ties go to the smaller k
    plain = by_name[fixed_policy_name(0)]
    table = by_name.get(TABLE_POLICY)
    batch = BatchResult(
        batch_size=batch_size, context_len=context_len, policies=policies, best_k=best.k,
        best_tokens_per_s=compared_rate(best), table_k=table.k if table else None,
        table_regret=1.0 - compared_rate(table) / compared_rate(best) if table else None,
        table_speedup=compared_rate(table) / compared_rate(plain) if table else None,
        strategy_comparison=strategy_comparison(policies, best, plain),
    )
    if has_peers:
        batch.peer_ratios = peer_ratios(batch, TABLE_POLICY if table else fixed_policy_name(best.k))
    return batch


# ---------------------------------------------------------------------------------------------- timing
def _now(device: torch.device) -> float:
    """Wall clock; on CUDA, after the queued kernels have run, so they are counted where they ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_ours(generator: SpeculativeGenerator, prompts: list[list[int]], policy, config: BenchConfig,
              seed: int) -> dict[str, Any]:
    """One generation with our runtime; the same outer wall clock as the peers."""
    start = _now(generator.device)
    result = generator.generate(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                config.synthetic_acceptance)
    seconds = _now(generator.device) - start
    stats, b = result.stats, len(prompts)
    full = [k for k, size in zip(stats.k_per_step, stats.batch_size_per_step) if size == b]
    nodes = [n for n, size in zip(stats.nodes_per_step, stats.batch_size_per_step) if size == b]
    return dict(generated_tokens=stats.generated_tokens, seconds=seconds, steps=stats.steps,
                full_batch_steps=len(full), accepted_per_position=list(stats.accepted_per_position),
                trials_per_position=list(stats.trials_per_position), k_counts_full_batch=dict(Counter(full)),
                nodes_counts_full_batch=dict(Counter(nodes)), steady_tokens_per_s=stats.steady_tokens_per_s(b))


# ---------------------------------------------------------------------------------------------- peers
@dataclass
class PeerModels:
    """Hugging Face copies of the pair, for --peers."""

    target: Any  # transformers PreTrainedModel
    draft: Any | None
    pad_token_id: int
    transformers_version: str


def load_peers(models: BenchModels, device: torch.device) -> tuple[PeerModels | None, str | None]:
    """The pair loaded with transformers, or (None, a one-line note saying why peers are skipped)."""
    if models.target_dir is None or (models.draft is not None and models.draft_dir is None):
        return None, "--peers skipped: it needs model directories (shape presets have no Hugging Face weights)"
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None, "--peers skipped: transformers is not installed (pip install transformers)"
    # generate() warns about every flag it ignores and loading draws its own progress bar: either
    # would break the CLI's progress bar and output
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    dtype = models.target.lm_head.weight.dtype  # the same as ours: float32 on CPU unless told otherwise

    def load(directory: Path):
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
        return model.to(device).eval()

    target = load(models.target_dir)
    draft = load(models.draft_dir) if models.draft is not None else None
    config = target.config
    pad = config.pad_token_id if config.pad_token_id is not None else 0  # masked out: any id will do
    return PeerModels(target=target, draft=draft, pad_token_id=int(pad),
                      transformers_version=transformers.__version__), None


def left_padded(prompts: list[list[int]], pad_token_id: int, device: torch.device):
    """(input_ids, attention_mask), both (b, longest prompt), padding on the left as generate() expects."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[r, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _hf_sampling(sampling: Sampling) -> dict[str, Any]:
    """Our sampling settings in generate()'s words (explicit, so a checkpoint's defaults cannot differ)."""
    if sampling.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p}


@torch.inference_mode()
def time_peer(peers: PeerModels, name: str, prompts: list[list[int]], config: BenchConfig,
              seed: int, device: torch.device) -> dict[str, Any]:
    """One Hugging Face generate() call: plain (batched, left padding) or assisted (b = 1).

    min_new_tokens = max_new_tokens suppresses EOS, so every row produces exactly max_new_tokens, as ours do.
    """
    ids, mask = left_padded(prompts, peers.pad_token_id, device)
    options = dict(max_new_tokens=config.max_new_tokens, min_new_tokens=config.max_new_tokens,
                   pad_token_id=peers.pad_token_id, **_hf_sampling(config.sampling))
    if name == HF_ASSISTED:
        options["assistant_model"] = peers.draft
    torch.manual_seed(seed)
    start = _now(device)
    output = peers.target.generate(input_ids=ids, attention_mask=mask, **options)  # (b, width + new)
    seconds = _now(device) - start
    return dict(generated_tokens=int(output.shape[0] * (output.shape[1] - ids.shape[1])), seconds=seconds)


# ---------------------------------------------------------------------------------------------- prediction
@dataclass(frozen=True)
class Predictor:
    """The performance model's goodput G(b, k, L) (perfmodel, from a specbatch.model/1 file)."""

    fitted: Any  # perfmodel.model.FittedModel
    acceptance: Any  # perfmodel.acceptance.AcceptanceModel
    acceptance_note: str  # which acceptance the predictions use, for bench.json

    def tokens_per_s(self, batch_size: int, k: int, context_len: int) -> float:
        return self.strategy_tokens_per_s(batch_size, Strategy.from_k(k), context_len)

    def strategy_tokens_per_s(self, batch_size: int, strategy: Strategy, context_len: int) -> float:
        """A tree's or a staged step's goodput; PerfModelError when the model lacks rank acceptance
        (trees) or second-stage measurements (+ngram)."""
        from perfmodel.model import evaluate_strategy

        return float(evaluate_strategy(self.fitted, strategy, batch_size, context_len, self.acceptance).tokens_per_s)


def load_predictor(model_path: str | os.PathLike, sampling: Sampling, synthetic_acceptance: float | None) -> Predictor:
    """Read the model file and pick the acceptance that matches how the bench generates.

    Synthetic runs accept with probability α at every position, so α is what the prediction must
    use. Real runs use the profile's measurement for the same decoding mode (greedy, or sampling at
    the same temperature) when the profile has one, else its first entry (and say so).
    """
    from perfmodel.acceptance import acceptance_from_user
    from perfmodel.model import choose_acceptance, load_model

    fitted = load_model(model_path)
    if synthetic_acceptance is not None:
        return Predictor(fitted, acceptance_from_user([synthetic_acceptance], "--synthetic-acceptance"),
                         f"synthetic α={synthetic_acceptance:g} at every position")
    mode = "greedy" if sampling.greedy else "sampling"
    for entry in fitted.acceptance:
        if entry.mode == mode and (sampling.greedy or entry.temperature == sampling.temperature):
            return Predictor(fitted, entry, f"the profile's {sampling.describe()} measurement")
    chosen = choose_acceptance(fitted, None, str(model_path))
    return Predictor(fitted, chosen, f"the profile's first acceptance entry ({chosen.mode}); none matches "
                                     f"{sampling.describe()}")


# ---------------------------------------------------------------------------------------------- the harness
def device_info(model: CausalLM) -> dict[str, Any]:
    weight = model.lm_head.weight
    return {"kind": weight.device.type, "name": device_name(str(weight.device)), "dtype": str(weight.dtype).removeprefix("torch."),
            "torch_version": torch.__version__, "cpu_threads": torch.get_num_threads()}


def _model_info(model: CausalLM | None, source: str | None, random_weights: bool) -> dict[str, Any] | None:
    if model is None:
        return None
    config = model.config
    return {"source": source, "model_type": config.model_type, "random_weights": random_weights,
            "parameters": config.parameter_count(), "layers": config.num_layers, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size}


def check_context(models: BenchModels, prompts: Sequence[list[int]], config: BenchConfig, max_k: int) -> None:
    """Every run must fit the models' context: the longest prompt + max_new_tokens + the KV-cache margin
    of max_k speculative positions (the most draft tokens a step verifies: the largest k of --ks and of
    the table, or the largest tree's node count)."""
    limit = models.target.config.max_position_embeddings
    if models.draft is not None:
        limit = min(limit, models.draft.config.max_position_embeddings)
    longest = max(len(p) for p in cycled_prompts(prompts, max(config.batch_sizes)))
    if longest + config.max_new_tokens + max_k > limit:
        raise BenchError(
            f"longest prompt ({longest} tokens) + --max-new-tokens ({config.max_new_tokens}) + largest k or tree "
            f"({max_k} draft tokens, the KV-cache margin) exceeds the models' context of {limit} positions; lower "
            f"--max-new-tokens, k or the tree's size"
        )


def timed_round_prompts(prompts: Sequence[list[int]], batch_size: int, config: BenchConfig) -> list[list[list[int]]]:
    """The prompts of every timed round at one batch size (each round takes the next batch_size)."""
    return [cycled_prompts(prompts, batch_size, offset=(r + config.warmup_rounds) * batch_size)
            for r in range(config.rounds)]


def resolve_auto_tree(predictor: Predictor, model_path, context_len: int, staged: bool) -> tuple[Tree, str]:
    """--tree auto: the performance model's best tree at batch size 1 and the bench's context, among
    grown trees ("tree" family) or, when a second stage is benchmarked and the model measured one,
    among trees with and without it ("all"). Returns the tree and why it was chosen, for the note."""
    from perfmodel.model import query_strategies

    if predictor.acceptance.rank_acceptance is None:
        raise BenchError(f"--tree auto: {model_path} has no rank acceptance (per depth and rank) in "
                         f"{predictor.acceptance_note}; calibrate again to measure it, or give a tree spec")
    family = "all" if staged and predictor.fitted.stage2 is not None else "tree"
    try:
        choice = query_strategies(predictor.fitted, predictor.acceptance, 1, context_len, strategies=family)
    except PerfModelError as error:
        raise BenchError(f"--tree auto: {error}") from None
    best = next((c for c in choice.ranked if c.strategy.kind == "tree"), None)
    if best is None:
        raise BenchError(f"--tree auto: {model_path} proposes no tree (its rank acceptance grows only chains); "
                         "give a tree spec")
    tree = best.strategy.tree
    why = (f"the performance model's best tree at batch size 1 and context {context_len} among its {family!r} "
           f"candidates ({best.strategy.describe(40)}: {best.tokens_per_s:.4g} tokens/s predicted); its "
           f"{tree.num_nodes} nodes: {tree.spec()}")
    return tree, why


def check_table(table, models: BenchModels, config: BenchConfig) -> None:
    """A table whose entries use trees or the second stage needs what they need."""
    strategies = {entry.chosen() for bucket in table.table.buckets for entry in bucket.entries}
    shaped = [s for s in strategies if s.kind == "tree" or s.stage2]
    if shaped and config.synthetic_acceptance is not None:
        raise BenchError(f"--table {config.table_path}: it uses {shaped[0].describe(40)}; --synthetic-acceptance "
                         "fakes acceptance for plain chains only")
    if table.needs_stage2 and models.stage2 is None:
        raise BenchError(f"--table {config.table_path}: its entries use the n-gram second stage; pass --stage2 FILE")


def run_bench(config: BenchConfig, models: BenchModels, prompts: Sequence[list[int]],
              on_run: Callable[[RunRecord, int, int], None] | None = None) -> BenchResult:
    """Measure every policy at every batch size in interleaved rounds; see the module docstring.

    `prompts` are token ids; batch size b uses the first b of them (cycling). EOS is ignored and every
    row generates exactly `max_new_tokens`, so the batch stays at b until rows that sped ahead under
    speculation finish (`full_batch_step_fraction` says how long). `on_run(record, done, total)` is
    called after every generation (the CLI's progress bar). Everything that can be refused (a missing
    draft or n-gram model, a bad model file, --tree auto's resolution) is refused before measuring.
    """
    from runtime.policy import TableK

    notes: list[str] = []
    fixed_ks = config.fixed_ks
    if models.draft is None and max(fixed_ks) > 0:
        raise BenchError("k > 0 needs a draft model (--draft)")
    if models.draft is None and config.trees:
        raise BenchError("--tree needs a draft model (--draft)")
    if config.stage2_path is not None and models.stage2 is None:
        raise BenchError(f"--stage2 {config.stage2_path}: the n-gram model was not loaded (BenchModels.stage2)")
    if models.stage2 is not None:
        if models.draft is None:
            raise BenchError("--stage2 speeds up a draft model's drafting: it needs a draft model (--draft)")
        if config.synthetic_acceptance is not None:
            raise BenchError("--stage2 cannot be combined with --synthetic-acceptance: the runtime fakes "
                             "acceptance for plain chains only")
    table = TableK(config.table_path) if config.table_path is not None else None
    if table is not None and models.draft is None:
        raise BenchError("--table needs a draft model (--draft)")
    if table is not None:
        check_table(table, models, config)
    predictor = None
    if config.model_path is not None:  # read before measuring: a bad file should fail in a second, not an hour
        predictor = load_predictor(config.model_path, config.sampling, config.synthetic_acceptance)
        notes.append(f"predictions use {predictor.acceptance_note}")
    trees, auto = [], None  # auto: (the tree --tree auto became, why)
    for spec in config.trees:
        if spec.strip() == TREE_AUTO:
            context_len = attended_context_len(timed_round_prompts(prompts, 1, config), config.max_new_tokens)
            auto = resolve_auto_tree(predictor, config.model_path, context_len, models.stage2 is not None)
            trees.append(auto[0])
        else:
            trees.append(tree_from_spec(spec))
    vocab = models.target.config.vocab_size
    for tree in trees:
        if tree.max_children > vocab:
            raise BenchError(f"--tree {tree_label(tree)}: a node has {tree.max_children} children, more than the "
                             f"vocabulary's {vocab} tokens")

    policies = bench_policies(fixed_ks, table, trees, stage2=models.stage2 is not None)
    if auto is not None:
        name = next(p.name for p in policies.values() if p.strategy == Strategy(auto[0]))
        notes.append(f"--tree auto became {name}, {auto[1]}")
    check_context(models, prompts, config, max(p.policy.max_k for p in policies.values()))
    device = models.target.lm_head.weight.device
    peers = None
    if config.peers:
        peers, note = load_peers(models, device)
        if note:
            notes.append(note)
    # EOS ignored on purpose: the batch must stay at b until max_new_tokens (module docstring)
    try:
        generator = SpeculativeGenerator(models.target, models.draft, eos_token_ids=(), stage2=models.stage2)
    except GenerationError as error:
        raise BenchError(f"--stage2: {error}") from None

    def contenders(b: int) -> list[str]:
        names = list(policies)
        if peers is not None:
            names.append(HF_GREEDY)
            if b == 1 and peers.draft is not None:  # transformers refuses assisted generation above b = 1
                names.append(HF_ASSISTED)
        return names

    total = sum(len(contenders(b)) * (config.warmup_rounds + config.rounds) for b in config.batch_sizes)
    runs: list[RunRecord] = []
    # warnings raised while measuring (e.g. a batch size beyond the table) become notes in the result
    # instead of lines in the middle of the progress bar
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for b in config.batch_sizes:
            names = contenders(b)
            for round_index in range(-config.warmup_rounds, config.rounds):
                seed = config.seed + round_index + config.warmup_rounds  # the same for every policy in a round
                batch_prompts = cycled_prompts(prompts, b, offset=(round_index + config.warmup_rounds) * b)
                for name in rotated(names, round_index):
                    if name in policies:
                        measured = time_ours(generator, batch_prompts, policies[name].policy, config, seed)
                    else:
                        measured = time_peer(peers, name, batch_prompts, config, seed, device)
                    runs.append(RunRecord(batch_size=b, round=round_index, policy=name, **measured))
                    if on_run is not None:
                        on_run(runs[-1], len(runs), total)
    notes += list(dict.fromkeys(f"warning: {w.message}" for w in caught))

    batches = [_batch_result(b, contenders(b), runs, config, timed_round_prompts(prompts, b, config), policies)
               for b in config.batch_sizes]
    if predictor is not None:
        notes += _add_predictions(batches, predictor, policies)
    prompt_lens = [len(p) for p in prompts]
    return BenchResult(
        config=config, device=device_info(models.target),
        models={"target": _model_info(models.target, models.target_source, models.random_weights),
                "draft": _model_info(models.draft, models.draft_source, models.random_weights),
                "peers": {"transformers_version": peers.transformers_version} if peers else None,
                "stage2": _stage2_info(models.stage2, config.stage2_path)},
        prompts={"count": len(prompts), "min_tokens": min(prompt_lens), "max_tokens": max(prompt_lens)},
        batches=batches, runs=runs, notes=notes,
    )


def _stage2_info(stage2, path: Path | None) -> dict[str, Any] | None:
    if stage2 is None:
        return None
    return {"file": str(path) if path is not None else None, "vocab_size": stage2.vocab_size,
            "note": dict(getattr(stage2, "note", {}))}


def table_strategy(table, batch_size: int, context_len: int) -> Strategy:
    """The table's strategy at a batch size and context, as TableK looks it up (without its warnings)."""
    bucket = table.table.bucket_for(context_len)
    return bucket.entries[min(batch_size, bucket.max_batch) - 1].chosen()


def _batch_result(b: int, names: list[str], runs: list[RunRecord], config: BenchConfig,
                  round_prompts: list[list[list[int]]], policies: dict[str, BenchPolicy]) -> BatchResult:
    timed = [r for r in runs if r.batch_size == b and not r.warmup]
    context_len = attended_context_len(round_prompts, config.max_new_tokens)
    results = []
    for name in names:
        records = [r for r in timed if r.policy == name]
        ours = policies.get(name)
        if ours is None:  # a peer
            k, strategy = None, None
        elif ours.strategy is None:  # the table
            k, strategy = most_frequent_k(records), table_strategy(ours.policy, b, context_len).describe()
        else:
            k, strategy = ours.strategy.k, ours.strategy.describe()
        results.append(summarize_policy(name, k, records, strategy))
    return summarize_batch(b, context_len, results, config.fixed_ks,
                           has_peers=any(r.policy in (HF_GREEDY, HF_ASSISTED) for r in timed))


def _add_predictions(batches: list[BatchResult], predictor: Predictor, policies: dict[str, BenchPolicy]) -> list[str]:
    """Predicted goodput for every fixed k, for the table's (most frequent) k, and for trees and staged
    steps (evaluate_strategy), at the run's mean context. Returns notes: one per policy family the model
    cannot predict (no rank acceptance for trees, no second-stage measurements for +ngram)."""
    failed: dict[str, tuple[list[str], str]] = {}  # family -> (policies, the first error)
    for batch in batches:
        for policy in batch.policies:
            ours = policies.get(policy.policy)
            if ours is None or policy.k is None:
                continue
            strategy = ours.strategy
            if strategy is None:  # the table
                strategy = table_strategy(ours.policy, batch.batch_size, batch.context_len)
            if strategy.kind != "tree" and not strategy.stage2:
                policy.predicted_tokens_per_s = predictor.tokens_per_s(batch.batch_size, policy.k, batch.context_len)
                continue
            try:
                policy.predicted_tokens_per_s = predictor.strategy_tokens_per_s(batch.batch_size, strategy,
                                                                                batch.context_len)
            except PerfModelError as error:
                names, _ = failed.setdefault(policy_family(policy.policy), ([], str(error)))
                if policy.policy not in names:
                    names.append(policy.policy)
    return [f"no prediction for {', '.join(names)}: {message}" for names, message in failed.values()]


# ---------------------------------------------------------------------------------------------- outputs
def bench_json(result: BenchResult) -> dict[str, Any]:
    """The `specbatch.bench/1` document."""
    config = result.config
    config_json = {
        "batch_sizes": list(config.batch_sizes), "ks": list(config.fixed_ks), "max_new_tokens": config.max_new_tokens,
        "rounds": config.rounds, "warmup_rounds": config.warmup_rounds, "sampling": config.sampling.describe(),
        "synthetic_acceptance": config.synthetic_acceptance, "seed": config.seed,
        "table": str(config.table_path) if config.table_path else None,
        "model": str(config.model_path) if config.model_path else None, "peers": config.peers,
        "trees": list(config.trees), "stage2": str(config.stage2_path) if config.stage2_path else None,
        "eos": "ignored: every row generates max_new_tokens",
        "tokens_per_s": "generated tokens / wall seconds of one generate() call, prefill and overhead included",
    }
    batches = []
    for batch in result.batches:
        entry = asdict(batch)
        for policy, source in zip(entry["policies"], batch.policies):
            policy["rounds"] = source.rounds
        batches.append(entry)
    runs = [{"order": i, "batch_size": r.batch_size, "round": r.round, "warmup": r.warmup, "policy": r.policy,
             "generated_tokens": r.generated_tokens, "seconds": r.seconds, "tokens_per_s": r.tokens_per_s}
            for i, r in enumerate(result.runs)]
    return {"schema": BENCH_SCHEMA, "synthetic": result.synthetic, "config": config_json, "device": result.device,
            "models": result.models, "prompts": result.prompts, "batch_sizes": batches, "runs": runs,
            "notes": result.notes}


def bench_csv(result: BenchResult) -> str:
    """One row per batch size x policy; numbers only (empty cell = not applicable)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    alpha = result.config.synthetic_acceptance
    for batch in result.batches:
        for p in batch.policies:
            writer.writerow([batch.batch_size, p.policy, _cell(p.k), _cell(p.median_tokens_per_s),
                             _cell(p.p10_tokens_per_s), _cell(p.p90_tokens_per_s), p.rounds, _cell(p.acceptance),
                             _cell(p.median_steady_tokens_per_s), _cell(p.predicted_tokens_per_s), _cell(alpha),
                             _cell(p.strategy)])
    return buffer.getvalue()


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_outputs(result: BenchResult, out_dir: str | os.PathLike) -> list[Path]:
    """bench.json, bench.csv and the PNG plots into `out_dir`; returns the paths written.

    Without matplotlib the plots are skipped and a note saying so is added to the result (and so to
    bench.json) before anything is written.
    """
    try:
        import matplotlib  # noqa: F401 - only to learn whether plots are possible
        plots = (("goodput_vs_k.png", plot_goodput_vs_k), ("speedup_vs_batch.png", plot_speedup_vs_batch))
    except ImportError:
        plots = ()
        result.notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.csv"]
    write_bytes_atomic(written[0], (json.dumps(bench_json(result), indent=1, allow_nan=False) + "\n").encode())
    write_bytes_atomic(written[1], bench_csv(result).encode())
    for name, plot in plots:
        write_bytes_atomic(out / name, plot(result))
        written.append(out / name)
    return written


def _figure_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def _title(result: BenchResult, text: str) -> str:
    label = result.synthetic
    return f"{text}\n{label}" if label else text


def _band(policy: PolicyResult) -> tuple[float, float]:
    """p10 and p90 of the figure `compared_rate` reports."""
    if policy.median_steady_tokens_per_s is not None:
        return policy.p10_steady_tokens_per_s, policy.p90_steady_tokens_per_s
    return policy.p10_tokens_per_s, policy.p90_tokens_per_s


def plot_goodput_vs_k(result: BenchResult) -> bytes:
    """Measured steady-state tokens/s vs fixed k (median, p10-p90 bars) per batch size; prediction and
    table overlaid; staged chains (k=K+ngram) as a second line, trees (plain and staged) as points at
    their depth."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    batches = result.batches
    columns = min(3, len(batches))
    rows = -(-len(batches) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, batch in zip(axes, batches):
        fixed = [p for p in batch.policies if policy_family(p.policy) == "chain"]
        ks = [p.k for p in fixed]
        # the figure policies are ranked by (steady state when measured), with its own p10-p90 band
        medians = np.array([compared_rate(p) for p in fixed])
        low = medians - np.array([_band(p)[0] for p in fixed])
        high = np.array([_band(p)[1] for p in fixed]) - medians
        ax.errorbar(ks, medians, yerr=[low, high], marker="o", capsize=3, label="measured (p10-p90)")
        predicted = [(p.k, p.predicted_tokens_per_s) for p in fixed if p.predicted_tokens_per_s is not None]
        if predicted:
            ax.plot(*zip(*predicted), linestyle="--", marker="x", label="predicted")
        staged_chains = [p for p in batch.policies if policy_family(p.policy) == "staged"
                         and not p.policy.startswith(TREE_PREFIX)]
        if staged_chains:
            ax.plot([p.k for p in staged_chains], [compared_rate(p) for p in staged_chains], marker="s",
                    color="C2", label="k + n-gram stage")
        for family, marker, color, label in (("tree", "^", "C4", "trees (at depth)"),
                                             ("staged", "v", "C5", "trees + n-gram (at depth)")):
            trees = [p for p in batch.policies if policy_family(p.policy) == family and p.policy.startswith(TREE_PREFIX)]
            if trees:
                ax.scatter([p.k for p in trees], [compared_rate(p) for p in trees], marker=marker, s=60, color=color,
                           zorder=3, label=label)
                ks += [p.k for p in trees]
        table = batch.policy(TABLE_POLICY)
        if table is not None and table.k is not None:
            ax.scatter([table.k], [compared_rate(table)], marker="*", s=160, color="C3", zorder=3,
                       label=f"table (k={table.k})")
        ax.set_title(f"batch size {batch.batch_size}")
        ax.set_xlabel("k (draft tokens per step; a tree's depth)")
        ax.set_ylabel("steady-state tokens/s")
        ax.set_xticks(sorted(set(ks)))
        ax.grid(alpha=0.3)
    for ax in axes[len(batches):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8)
    figure.suptitle(_title(result, "goodput vs k"))
    return _figure_png(figure)


def _legend_label(name: str, max_chars: int = 32) -> str:
    """A policy name short enough for a legend, keeping the +ngram suffix that tells staged from plain.

    >>> _legend_label("tree:0,1,2,0.0,0.1,0.2,1.0,1.1,...(12 nodes)+ngram", 24)
    'tree:0,1,2,0.0,...+ngram'
    """
    if len(name) <= max_chars:
        return name
    tail = STAGED_SUFFIX if name.endswith(STAGED_SUFFIX) else ""
    return name[:max_chars - len(tail) - 3] + "..." + tail


def plot_speedup_vs_batch(result: BenchResult) -> bytes:
    """Speedup over k = 0 vs batch size, one line per fixed k, a bold one for the table and a dashed one
    per tree and staged policy."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = figure.subplots()
    sizes = [batch.batch_size for batch in result.batches]

    def speedups(name: str) -> list[float]:
        values = []
        for batch in result.batches:
            policy, plain = batch.policy(name), batch.policy(fixed_policy_name(0))
            values.append(compared_rate(policy) / compared_rate(plain) if policy else float("nan"))
        return values

    for k in result.config.fixed_ks:
        if k > 0:
            ax.plot(sizes, speedups(fixed_policy_name(k)), marker=".", linewidth=1, alpha=0.7, label=f"k={k}")
    if result.config.table_path is not None:
        ax.plot(sizes, speedups(TABLE_POLICY), marker="*", markersize=10, linewidth=2.5, color="black",
                label="table")
    shaped = dict.fromkeys(p.policy for batch in result.batches for p in batch.policies
                           if policy_family(p.policy) in ("tree", "staged"))
    for name in shaped:
        ax.plot(sizes, speedups(name), marker="^" if policy_family(name) == "tree" else "v", linestyle="--",
                linewidth=1.5, label=_legend_label(name))
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over k = 0 (steady-state tokens/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(_title(result, "speedup over plain decoding"))
    return _figure_png(figure)
