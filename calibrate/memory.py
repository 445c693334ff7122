"""What each stage of calibration holds in device memory at once, and the plan that keeps every point
within what the device has free: points that cannot fit are named before anything is measured, and the
ks of an in-situ batch size are generated in lockstep only as many at a time as fit.

Per stage (both models' weights are resident throughout):
- isolated passes (calibrate.benchmarks.ForwardTimer): one model's cache of b rows x (L + the widest n
  timed at b) tokens, and one pass;
- step overheads and tree overheads: a generation on 8-token prompts (both caches) and its widest pass;
- in situ (calibrate.insitu): the generations of a lockstep group are alive together, each with its own
  target cache and, for k > 0, draft cache of b rows x (longest prompt + new tokens + k + 1) tokens (the
  generator's buffer), plus the largest pass any of them runs: its prefill of b x prompt tokens, or its
  verify pass.

A pass's transient memory: activations of one layer at a time (the MLP's gate and up, or a mixture of
experts' rows, one per (token, expert) pair; a few hidden-size tensors), its logits in the model's dtype and
in float32, the attention mask, and, when the attention kernel is the math one (`scores_materialized`), the
attention scores and their softmax in float32.
With CUDA graphs (calibrate's default on CUDA), each model's graphs add their memory pool, shared by all
of them (the transient memory of the largest pass captured, once), and one logits buffer per batch bucket and
width (tokens per row), shared by every cache's graph of that key (runtime.cuda_graphs); the caches get a
bucket's rows, and a generation's cache its slots per row rounded up to a multiple of 128 (runtime.cache_pool).
Graphs of a bucket are captured with every smaller bucket at that width (the ladder). With a head drafting,
the target's verify graphs also write the hidden states the head reads (one features buffer per bucket and
width), and the head's graphs hold theirs: its inputs, outputs and drafting logits (`head_graph_bytes`).

Assumptions: the caching allocator reuses what a finished generation freed (calibrate empties its cache
between stages), and HEADROOM of the free memory covers its rounding, cuBLAS workspaces and the
temporaries not counted here. A head reads HEAD_FEATURE_LAYERS of the target's hidden states per position
(EAGLE-3's default three; a head configured with other layers needs proportionally more or less).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from specbatch.perfmodel.profile import Grid, ModelInfo

from specbatch.runtime.cuda_graphs import BATCH_BUCKETS, DRAFT_GRAPH_MAX_WIDTH, SLOT_GRANULARITY, bucket_for

from .errors import CalibrationError
from .grid import new_tokens_at

GIB = 1024 ** 3
HEADROOM = 0.9  # plan within 90 % of the free memory: allocator rounding, cuBLAS workspaces, small temporaries
PROMPT_TOKENS = 8  # the overhead and tree samplers' prompts (calibrate.benchmarks, calibrate.run)
TOKEN_ID_BYTES = 8  # the generator's token buffer is int64
SHOWN_LABELS = 8  # skipped points named in a note, per stage
HEAD_FEATURE_LAYERS = {"eagle3": 3, "mtp": 1}  # target hidden states a head reads: low, middle, high; the normed output
PAIR_BYTES = 3 * 8 + 4  # a MoE layer's (token, expert) pair: its expert id, sort position and row (int64), weight


def _element_bytes(info: ModelInfo) -> int:
    return max(1, info.weight_bytes // info.parameters)


def kv_bytes(info: ModelInfo, rows: int, tokens: int) -> int:
    """A KV cache of `rows` rows with room for `tokens` tokens each."""
    return info.kv_bytes_per_token * rows * tokens


def expert_layer_bytes(info: ModelInfo, tokens: int) -> int:
    """The transient memory of one mixture-of-experts layer over `tokens` tokens (runtime.experts.RoutedExperts
    .forward): each of a token's k (token, expert) pairs gets a row of its own, and the layer's largest moment is
    - the products: the grouped GEMM's gathered rows and gate-up output, then gate-up, activation and gated
      product (CUDA in bfloat16); or the output rows and one expert's products, for at most every token (else);
    - or the weighting: the products and their copy in token order, and their product with the routing weights
      (float32 but for Qwen3-MoE, a 16-bit model's rows converted to float32 first) or its sum over the k;
    beside each pair's expert id, sort position, source row and weight, and each expert's row count (int64; the
    grouped GEMM's running sums, int32). The router's (tokens x experts) scores, freed before, and GLM-4.5's
    shared expert after the weighting hold less for every published shape: HEADROOM's."""
    experts, element, hidden = info.experts, _element_bytes(info), info.hidden_size
    width = experts.expert_parameters // (3 * hidden)  # the gate, up and down projections of one expert
    pairs = tokens * experts.experts_per_token
    gated = max(hidden + 2 * width, 4 * width)  # per row: the input and gate-up; or gate-up, activation, product
    products = max(pairs * gated, pairs * hidden + tokens * gated) * element
    weights = element if info.model_type == "qwen3_moe" else 4
    widened = 4 if weights != element else 0  # the rows converted to float32 to multiply float32 weights
    weighting = 2 * pairs * hidden * element + max(pairs * hidden * (weights + widened),
                                                   (pairs + tokens) * hidden * weights)
    return pairs * PAIR_BYTES + experts.num_experts * (8 + 4) + max(products, weighting)


def pass_bytes(info: ModelInfo, rows: int, new_tokens: int, key_len: int, logits_tokens: int,
               scores_materialized: bool) -> int:
    """The transient memory of one forward pass of `rows` x `new_tokens` tokens over `key_len` keys, whose LM
    head runs on `logits_tokens` positions (a prefill: one per row; a decode pass: every fed token). A
    mixture of experts' layers hold their (token, expert) rows (`expert_layer_bytes`) where a dense MLP holds
    its gate and up; its dense layers, if any, their MLP's."""
    element = _element_bytes(info)
    tokens = rows * new_tokens
    mlp = 3 * info.intermediate_size * tokens * element
    if info.experts is not None:
        moe = expert_layer_bytes(info, tokens)
        mlp = moe if info.experts.moe_layers == info.layers else max(mlp, moe)
    activations = 6 * info.hidden_size * tokens * element + mlp
    logits = logits_tokens * info.vocab_size * (element + 4)
    mask = tokens * key_len  # bool, broadcast over heads
    scores = tokens * info.heads * key_len * 8 if scores_materialized else 0  # float32 scores and softmax
    return activations + logits + mask + scores


def ladder(bucket: int) -> list[int]:
    """The buckets captured with `bucket` (runtime.cuda_graphs: every smaller one, at the same width).

    >>> ladder(8), ladder(5)
    ([1, 2, 4, 8], [1, 2, 4, 5])
    """
    return [b for b in BATCH_BUCKETS if b < bucket] + [bucket]


def logits_buffer_bytes(vocab_size: int, element_bytes: int, buckets: Sequence[int], widths: Sequence[int],
                        last_only: bool) -> int:
    """One logits buffer per (bucket, width): bucket rows x (the width's positions, or the last one) x vocab."""
    positions = len(widths) if last_only else sum(widths)
    return sum(buckets) * positions * vocab_size * element_bytes


def head_feature_size(head: ModelInfo) -> int:
    """The width of the target's hidden states a head reads per position."""
    return HEAD_FEATURE_LAYERS[head.drafter] * head.hidden_size


def graph_bytes(info: ModelInfo, top_bucket: int, widths: Sequence[int], last_only: bool, key_len: int,
                scores_materialized: bool, feature_size: int = 0) -> int:
    """One model's CUDA graphs for the ladder up to `top_bucket` at `widths`: the shared pool (the widest
    pass's transient memory, once), the logits buffers and, for a head's target, the features buffers
    (`feature_size` per position)."""
    widest = max(widths)
    pool = pass_bytes(info, top_bucket, widest, key_len, top_bucket * (1 if last_only else widest),
                      scores_materialized)
    element, buckets = _element_bytes(info), ladder(top_bucket)
    features = sum(buckets) * sum(widths) * feature_size * element
    return pool + logits_buffer_bytes(info.vocab_size, element, buckets, widths, last_only) + features


def head_graph_bytes(head: ModelInfo, top_bucket: int, widths: Sequence[int], key_len: int,
                     scores_materialized: bool) -> int:
    """A head's CUDA graphs (runtime.cuda_graphs.GraphedHead) for the ladder up to `top_bucket`: the pool (its
    widest pass), the drafting pass's buffers (one token: its own output in, logits over the target's vocabulary
    out) and, at each of `widths`, a pass over verified positions' (the target's features in); every pass's
    outputs out. An upper bound: a pass a run never makes is counted too (drafting when k < 2; calibration's
    isolated passes at width 1, which only draft)."""
    element, rows = _element_bytes(head), sum(ladder(top_bucket))
    pool = pass_bytes(head, top_bucket, max(widths), key_len, top_bucket, scores_materialized)
    drafting = rows * (head.hidden_size + head.vocab_size) * element  # inputs and logits (its outputs: at width 1)
    verified = rows * sum(widths) * (head_feature_size(head) + head.hidden_size) * element  # inputs, outputs
    outputs_at_one = 0 if 1 in widths else rows * head.hidden_size * element
    return pool + drafting + verified + outputs_at_one


def generation_graph_bytes(target: ModelInfo, draft: ModelInfo, rows: int, ks: Sequence[int], key_len: int,
                           scores_materialized: bool) -> int:
    """The graphs generations of `ks` at `rows` rows capture (shared by all of them): the target's decode and
    verify widths 1 and k + 1 (every position's logits), the draft's 1 and 2 (catch-up; the last position's).
    A head instead: the target's features at those widths (at 1 too: a drafting generation's k = 0 steps feed the
    head), the head's drafting pass and its passes over k + 1 verified positions."""
    top = bucket_for(rows, 10**9)
    drafting = any(k > 0 for k in ks)
    features = head_feature_size(draft) if drafting and draft.is_head else 0
    graphs = graph_bytes(target, top, sorted({1} | {k + 1 for k in ks}), False, key_len, scores_materialized,
                         features)
    if drafting and draft.is_head:
        graphs += head_graph_bytes(draft, top, sorted({k + 1 for k in ks}), key_len, scores_materialized)
    elif drafting:
        graphs += graph_bytes(draft, top, list(range(1, DRAFT_GRAPH_MAX_WIDTH + 1)), True, key_len,
                              scores_materialized)
    return graphs


def serving_graph_bytes(target: ModelInfo, draft: ModelInfo | None, max_batch: int, max_k: int,
                        key_len: int, scores_materialized: bool = False) -> int:
    """What a server's CUDA graphs may hold: every bucket to `max_batch`'s, the target at widths 1..max_k + 1,
    the draft (when there is one and k > 0) at 1 and 2."""
    ks = list(range(max_k + 1)) if draft is not None else [0]
    return generation_graph_bytes(target, draft, max_batch, ks, key_len, scores_materialized)


def generation_bytes(target: ModelInfo, draft: ModelInfo, rows: int, k: int, longest_prompt: int,
                     new_tokens: int, slot_granularity: int = 1) -> int:
    """What one generation keeps while it runs: its token buffer and caches (runtime.generator's buffer:
    longest prompt + new tokens + k + 1 per row; no draft cache at k = 0). A cache's slots per row are the
    buffer rounded up to `slot_granularity` (with graphs, runtime.cache_pool rounds to SLOT_GRANULARITY)."""
    buffer = longest_prompt + new_tokens + k + 1
    slots = -(-buffer // slot_granularity) * slot_granularity
    caches = kv_bytes(target, rows, slots) + (kv_bytes(draft, rows, slots) if k > 0 else 0)
    return caches + rows * buffer * TOKEN_ID_BYTES


def generation_peak_pass_bytes(target: ModelInfo, draft: ModelInfo, rows: int, k: int, longest_prompt: int,
                               new_tokens: int, scores_materialized: bool) -> int:
    """The largest pass of one generation: a prefill (logits at one position a row; none for the draft) or its
    verify pass."""
    buffer = longest_prompt + new_tokens + k + 1
    prefill = pass_bytes(target, rows, longest_prompt, longest_prompt, rows, scores_materialized)
    verify = pass_bytes(target, rows, k + 1, buffer, rows * (k + 1), scores_materialized)
    draft_prefill = pass_bytes(draft, rows, longest_prompt, longest_prompt, 0, scores_materialized) if k > 0 else 0
    return max(prefill, verify, draft_prefill)  # the draft's decode passes (1 or 2 tokens a row) are smaller


def lockstep_bytes(target: ModelInfo, draft: ModelInfo, rows: int, ks: Sequence[int], longest_prompt: int,
                   new_tokens: int, scores_materialized: bool, graphs: bool = False) -> int:
    """The generations of `ks` alive together (calibrate.lockstep) and the largest pass any of them runs
    (with `graphs`: their caches of the bucket's rows, and the graphs they share)."""
    cache_rows, granularity = (bucket_for(rows, 10**9), SLOT_GRANULARITY) if graphs else (rows, 1)
    caches = sum(generation_bytes(target, draft, cache_rows, k, longest_prompt, new_tokens, granularity) for k in ks)
    held = caches + max(generation_peak_pass_bytes(target, draft, rows, k, longest_prompt, new_tokens,
                                                   scores_materialized) for k in ks)
    if graphs:
        held += generation_graph_bytes(target, draft, rows, ks, longest_prompt + new_tokens + max(ks) + 1,
                                       scores_materialized)
    return held


def timing_point_bytes(info: ModelInfo, grid: Grid, role: str, rows: int, new_tokens: int, context_len: int,
                       scores_materialized: bool, graphs: bool = False) -> int:
    """An isolated pass: the ForwardTimer's cache (room for the widest n timed at this b) and the pass; with
    `graphs`, the cache has the bucket's rows and the graphs of every width timed at b are alive."""
    widths = new_tokens_at(grid, role, rows)
    key_len = context_len + max(widths)
    if graphs:
        top = bucket_for(rows, 10**9)
        graphed = (head_graph_bytes(info, top, widths, key_len, scores_materialized) if info.is_head
                   else graph_bytes(info, top, widths, role == "draft", key_len, scores_materialized))
        return kv_bytes(info, top, key_len) + graphed
    return kv_bytes(info, rows, key_len) + pass_bytes(info, rows, new_tokens, context_len + new_tokens,
                                                      rows * new_tokens, scores_materialized)


def sampler_generation_bytes(target: ModelInfo, draft: ModelInfo, rows: int, draft_tokens: int,
                             new_tokens: int, scores_materialized: bool, graphs: bool = False) -> int:
    """A step-overhead sample (chain k or a tree of `draft_tokens` nodes) on PROMPT_TOKENS-token prompts."""
    return lockstep_bytes(target, draft, rows, [draft_tokens], PROMPT_TOKENS, new_tokens, scores_materialized,
                          graphs)


@dataclass(frozen=True)
class MemoryBudget:
    """The device's free memory and what the plan may use of it beyond both models' weights."""

    device: str
    available_bytes: int
    weight_bytes: int
    reserved_bytes: int = 0  # held all run long beside the weights: the reference passes' caches

    @property
    def usable_bytes(self) -> int:
        return int(self.available_bytes * HEADROOM)

    @property
    def room_bytes(self) -> int:
        """What a stage may hold beside the weights and the reserved caches."""
        return self.usable_bytes - self.weight_bytes - self.reserved_bytes

    def fits(self, stage_bytes: int) -> bool:
        return stage_bytes <= self.room_bytes

    def reserve(self, held_bytes: int) -> MemoryBudget:
        return MemoryBudget(self.device, self.available_bytes, self.weight_bytes, self.reserved_bytes + held_bytes)

    def reason(self, stage_bytes: int) -> str:
        """'X GiB beside the weights' W GiB, where F GiB are free': what a need that does not fit is told with."""
        resident = (self.weight_bytes + self.reserved_bytes) / GIB
        held = " and reference caches" if self.reserved_bytes else ""
        return (f"{stage_bytes / GIB:.2f} GiB beside {resident:.2f} GiB of weights{held}, where "
                f"{self.available_bytes / GIB:.2f} GiB are free on {self.device} "
                f"({100 * HEADROOM:.0f} % of it planned)")


def reference_bytes(target: ModelInfo, rows: int, context_len: int, scores_materialized: bool) -> int:
    """A reference pass (calibrate.noise.reference_sampler): its cache, kept all run long, and the pass."""
    return kv_bytes(target, rows, context_len + 1) + pass_bytes(target, rows, 1, context_len + 1, rows,
                                                                 scores_materialized)


def memory_budget(target: ModelInfo, draft: ModelInfo, available_bytes: int, device: str) -> MemoryBudget:
    """The budget; when the weights alone leave no room, refused in one line (`weights_refusal`). Callers ask
    before loading: a shape preset's random weights are never allocated to find out."""
    budget = MemoryBudget(device, available_bytes, target.weight_bytes + draft.weight_bytes)
    if budget.room_bytes <= 0:
        raise CalibrationError(weights_refusal(target, draft, budget))
    return budget


def weights_refusal(target: ModelInfo, draft: ModelInfo, budget: MemoryBudget) -> str:
    """What the weights need against what is free, and where the pair can be timed instead: on a GPU where its
    bfloat16 weights fit within HEADROOM (caches and passes need more), here in bfloat16 where that fits, or, for
    dense blocks, composed from vidur's published GPU timings (calibrate --from-vidur, which has no experts)."""
    element = _element_bytes(target)
    sizes = " and ".join(f"--{role} {info.source} ({info.weight_bytes / GIB:.1f} GiB)"
                         for role, info in (("target", target), ("draft", draft)))
    half = (target.parameters + draft.parameters) * 2
    ways = [] if element <= 2 or half > budget.usable_bytes else [f"with --dtype bfloat16 ({half / GIB:.1f} GiB)"]
    ways.append(f"on a GPU with more than {math.ceil(half / HEADROOM / GIB)} GiB free")
    if target.experts is None and draft.experts is None:
        ways.append("from published GPU timings with calibrate --from-vidur DIR")
    return (f"{sizes}: the weights need {budget.weight_bytes / GIB:.1f} GiB at {element} bytes a parameter, and "
            f"{budget.available_bytes / GIB:.1f} GiB are free on {budget.device} ({100 * HEADROOM:.0f} % of it "
            f"planned); time the pair {', '.join(ways[:-1]) + ' or ' if len(ways) > 1 else ''}{ways[-1]}")


def lockstep_split(target: ModelInfo, draft: ModelInfo, rows: int, ks: Sequence[int], longest_prompt: int,
                   new_tokens: int, scores_materialized: bool,
                   budget: MemoryBudget, graphs: bool = False) -> tuple[list[list[int]], list[int]]:
    """The ks of one in-situ batch size as consecutive lockstep groups that each fit, and the ks that do
    not fit even alone. Groups are as large as fit, in the given order, so the ks the table chooses between
    stay side by side where memory allows."""
    groups: list[list[int]] = []
    alone: list[int] = []
    for k in ks:
        if not budget.fits(lockstep_bytes(target, draft, rows, [k], longest_prompt, new_tokens, scores_materialized,
                                          graphs)):
            alone.append(k)
        elif groups and budget.fits(lockstep_bytes(target, draft, rows, groups[-1] + [k], longest_prompt, new_tokens,
                                                   scores_materialized, graphs)):
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups, alone


@dataclass(frozen=True)
class MemoryPlan:
    """Which points a run skips because they cannot fit, how the in-situ ks are grouped, and what to say."""

    skipped: frozenset  # the points (calibrate.grid / calibrate.insitu point objects) not measured
    lockstep_ks: dict[int, list[list[int]]]  # in-situ batch size -> its ks' lockstep groups, in order
    notes: tuple[str, ...]  # one line each, said before measuring
    large_reference: bool = True  # whether the reference pass at the largest batch size fits beside the rest


def plan_memory(target: ModelInfo, draft: ModelInfo, grid: Grid, budget: MemoryBudget, scores_materialized: bool,
                timings: Sequence, overheads: Sequence, trees: Sequence, insitu: Sequence, overhead_steps: int,
                tree_steps: int, insitu_prompt_tokens: int, insitu_new_tokens: int, graphs: bool = False) -> MemoryPlan:
    """The plan for the points still to measure (calibrate.run's lists). Sample sizes are bounded from above:
    an overhead sample of k generates at most 1 + steps x (k + 1) tokens a row, a tree's 1 + steps x (N + 1)."""
    models = {"target": target, "draft": draft}
    skipped: dict[object, tuple[str, int]] = {}  # point -> (label, bytes it needs beside the weights)
    by_stage: dict[str, list[object]] = {}

    def check(stage: str, point, label: str, stage_bytes: int) -> None:
        if not budget.fits(stage_bytes):
            skipped[point] = (label, stage_bytes)
            by_stage.setdefault(stage, []).append(point)

    for p in timings:
        check("isolated passes", p, f"{p.model} b={p.batch_size} n={p.new_tokens} L={p.context_len}",
              timing_point_bytes(models[p.model], grid, p.model, p.batch_size, p.new_tokens, p.context_len,
                                 scores_materialized, graphs))
    for p in overheads:
        check("step overheads", p, f"overhead b={p.batch_size} k={p.k}",
              sampler_generation_bytes(target, draft, p.batch_size, p.k, 1 + overhead_steps * (p.k + 1),
                                       scores_materialized, graphs))
    for p in trees:
        check("tree overheads", p, f"tree overhead b={p.batch_size} nodes={p.tree_nodes}",
              sampler_generation_bytes(target, draft, p.batch_size, p.tree_nodes,
                                       1 + tree_steps * (p.tree_nodes + 1), scores_materialized, graphs))
    for role in models:
        passes = [p for p in timings if p.model == role]
        if passes and all(p in skipped for p in passes):  # nothing to fit a latency model to
            label, need = min((skipped[p] for p in passes), key=lambda item: item[1])
            raise CalibrationError(f"--batch-sizes/--context-lens: no {role} pass of the grid fits on {budget.device} "
                                   f"(the smallest, {label}, needs {budget.reason(need)}); lower --batch-sizes or "
                                   "--context-lens, or use a smaller --dtype")
    lockstep_ks: dict[int, list[list[int]]] = {}
    notes: list[str] = []
    for b in sorted({p.batch_size for p in insitu}):
        ks = sorted({p.k for p in insitu if p.batch_size == b})
        groups, alone = lockstep_split(target, draft, b, ks, insitu_prompt_tokens, insitu_new_tokens,
                                       scores_materialized, budget, graphs)
        if groups:
            lockstep_ks[b] = groups
        for p in insitu:
            if p.batch_size == b and p.k in alone:
                check("in-situ generations", p, f"in-situ b={b} k={p.k}",
                      lockstep_bytes(target, draft, b, [p.k], insitu_prompt_tokens, insitu_new_tokens,
                                     scores_materialized, graphs))
        if len(groups) > 1:
            together = lockstep_bytes(target, draft, b, ks, insitu_prompt_tokens, insitu_new_tokens,
                                      scores_materialized, graphs)
            notes.append(f"memory: in situ at b={b} the ks run in {len(groups)} lockstep groups "
                         f"({' | '.join(','.join(map(str, g)) for g in groups)}): all together "
                         + "they need " + budget.reason(together))
    for stage, points in by_stage.items():
        labels = [skipped[p][0] for p in points]
        shown = "; ".join(labels[:SHOWN_LABELS]) + (f"; and {len(labels) - SHOWN_LABELS} more"
                                                    if len(labels) > SHOWN_LABELS else "")
        smallest = min(skipped[p][1] for p in points)
        notes.append(f"memory: skipping {len(points)} {stage} that cannot fit ({shown}): the smallest needs "
                     + budget.reason(smallest))
    return MemoryPlan(frozenset(skipped), lockstep_ks, tuple(notes))
