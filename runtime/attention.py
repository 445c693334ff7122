"""How a forward pass over the KV cache attends: every row over its own keys, and no more.

A pass is planned once on the host from `KVCache.host_lengths` (the keys each row spans) and computed on the
device from `KVCache.lengths`, so it never reads the device back; every layer reuses the plan.
`UniformPass`: n new tokens per row (decode, verify, draft passes, trees under a `TreeAttention`).
`RaggedPass`: row r feeds its own n_r tokens, packed (a prefill: no padding in the linear layers).
Backends: "sdpa" over contiguous runs of rows, cut by the device's cost model (runtime.devices), and
"varlen", flash attention straight over the cache's slots (CUDA, half precision; a tree pass merges the
committed prefix and the in-flight nodes by their log-sum-exp). docs/runtime.md has the details.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from .devices import DeviceKind, attention_backend, device_kind
from .devices import cuda as cuda_device
from .kv_cache import KVCache, upload


def flash_varlen_call(device):
    """The flash varlen call a varlen pass makes on `device` (runtime.devices.cuda; tests give a stand-in)."""
    found = cuda_device.flash_varlen(device)
    if found.attend is None:
        raise RuntimeError(f"attention backend varlen requested on {device}, where it is unusable: {found.reason}")
    return found.attend


@dataclass(frozen=True)
class TreeAttention:
    """Tokens that form a tree (or a chain followed by a tree) on top of each row's cached prefix.

    The cache of every row holds `base[r]` committed tokens and then `m` in-flight slots of the same
    tree for every row (fed by earlier passes of this step); this pass appends `n` more. `offsets`
    (m + n,) are the in-flight slots' positions relative to `base` (a node's depth, for a tree), and
    `mask` (n, m + n) says which in-flight slots each new token may attend to (its ancestors and
    itself). Every new token also sees the whole committed prefix. Positions feed RoPE or learned
    position embeddings; slots are where keys and values are stored: they differ inside a tree.
    """

    offsets: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self):
        if self.mask.dim() != 2 or self.offsets.shape != (self.mask.shape[1],):
            raise ValueError(f"tree attention: mask {tuple(self.mask.shape)} does not match offsets "
                             f"{tuple(self.offsets.shape)}")

    @property
    def in_flight(self) -> int:
        """Slots of this tree the rows hold before the pass plus the pass's own (m + n)."""
        return self.mask.shape[1]


def choose_backend(cache: KVCache, requested: str | None, tree: TreeAttention | None, window: int | None) -> str:
    """`requested` (a model's `attention_backend`) or the device's choice (runtime.devices). A tree under a
    sliding window always goes through sdpa (its positions are not the slots' order)."""
    if tree is not None and window:
        return "sdpa"
    return requested or attention_backend(cache.device, cache.keys.dtype)


# ---------------------------------------------------------------------------------------------- planning
def plan_runs(totals: np.ndarray, kind: DeviceKind) -> list[tuple[int, int, int]]:
    """Contiguous runs of rows (start, end, keys) covering every row, each spanning its own longest row's
    `totals`: the cut that costs least by the device's sdpa cost model (one run unless the rows differ by more
    than a call's cost, or when the device has no such model).

    >>> from specbatch.runtime.devices.cpu import CPU
    >>> plan_runs(np.array([21, 517, 21, 21]), CPU)
    [(0, 1, 21), (1, 2, 517), (2, 4, 21)]
    >>> plan_runs(np.array([21, 25, 23]), CPU)
    [(0, 3, 25)]
    """
    b = len(totals)
    lowest = int(totals.min())
    call_keys, row_keys = kind.sdpa_call_keys, kind.sdpa_row_keys
    if b == 1 or call_keys is None or int(totals.max()) - lowest <= row_keys + call_keys:
        return [(0, b, int(totals.max()))]
    # adding the same count to every row adds the same cost to every cut: the cut depends on the differences
    # only, which the passes of one step share (each adds its tokens to every row)
    relative = np.asarray(totals - lowest, dtype=np.int64).tobytes()
    return [(start, end, keys + lowest) for start, end, keys in _cheapest_cut(relative, call_keys, row_keys)]


@lru_cache(maxsize=64)
def _cheapest_cut(relative: bytes, call_keys: int, row_keys: int) -> tuple[tuple[int, int, int], ...]:
    """The least-cost cut of rows into contiguous runs (dynamic programming over where the last run starts):
    cost[e] = min over s < e of cost[s] + call_keys + (e - s) * (row_keys + max(totals[s:e]))."""
    totals = np.frombuffer(relative, dtype=np.int64)
    b = len(totals)
    cost, start = np.zeros(b + 1), np.zeros(b + 1, dtype=np.int64)
    for end in range(1, b + 1):
        longest = np.maximum.accumulate(totals[end - 1::-1])  # [j]: the longest of the last j + 1 rows
        sizes = np.arange(1, end + 1)
        candidates = cost[end - 1::-1] + call_keys + sizes * (row_keys + longest)
        best = int(candidates.argmin())
        cost[end], start[end] = candidates[best], end - 1 - best
    runs, end = [], b
    while end > 0:
        first = int(start[end])
        runs.append((first, end, int(totals[first:end].max())))
        end = first
    return tuple(reversed(runs))


def equal_length_spans(lengths: np.ndarray, most: int) -> list[tuple[int, int, int]] | None:
    """Contiguous spans of rows of one length (start, end, length), or None when there are more than `most`
    of them (the device's `slice_write_spans`: one scatter then costs less than the slice copies).

    >>> equal_length_spans(np.array([9, 6, 6]), 4)
    [(0, 1, 9), (1, 3, 6)]
    """
    if not len(lengths) or most <= 0:
        return None
    cuts = (np.flatnonzero(np.diff(lengths)) + 1).tolist()
    if len(cuts) >= most:
        return None
    bounds = [0, *cuts, len(lengths)]
    return [(start, end, int(lengths[start])) for start, end in zip(bounds, bounds[1:])]


def prefill_groups(counts: list[int], padding: float) -> list[list[int]]:
    """Rows of a fresh prefill grouped for padded attention: by decreasing length, a group closed when
    padding its rows to its longest would exceed `padding` (the device's `prefill_padding`) times their own
    tokens.

    >>> prefill_groups([16, 512, 16, 15], 1.25)
    [[1], [0, 2, 3]]
    """
    order = sorted(range(len(counts)), key=lambda r: -counts[r])
    groups: list[list[int]] = []
    for row in order:
        if groups:
            group = groups[-1]
            longest = counts[group[0]]
            if longest * (len(group) + 1) <= padding * (sum(counts[r] for r in group) + counts[row]):
                group.append(row)
                continue
        groups.append([row])
    return groups


def _window_of(windowed: bool, window: int | None) -> int | None:
    return window if windowed else None


def _causal(keys: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key j is visible from a query at position p: j <= p (and j > p - window). (..., n, key_len)."""
    allowed = keys <= positions[..., None]
    if window:
        allowed &= keys > positions[..., None] - window
    return allowed


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as the additive one (0 where allowed, -inf elsewhere) that sdpa would otherwise build
    from it at every call: a pass plans its masks once and every layer reuses them."""
    return torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device).masked_fill_(allowed, 0)


def _sdpa(q, k, v, mask, gqa: bool, causal: bool = False) -> torch.Tensor:
    """Attention over (rows, heads, tokens, head_dim) layouts; q, k and v are given tokens-first
    (rows, tokens, heads, head_dim) and the result comes back tokens-first."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=causal and mask is None, enable_gqa=gqa)
    return out.transpose(1, 2)


class UniformPass:
    """n new tokens per row on top of the cache; `tree`: they form (part of) a tree of in-flight slots."""

    def __init__(self, cache: KVCache, n: int, tree: TreeAttention | None, window: int | None, backend: str):
        device, b = cache.device, cache.batch_size
        kind = device_kind(device)
        self.n, self.tree, self.window, self.backend = n, tree, window, backend
        lengths = cache.lengths
        self.rows = torch.arange(b, device=device)[:, None]
        self.slots = lengths[:, None] + torch.arange(n, device=device)  # (b, n): where keys are written
        if tree is None:
            self.positions = self.slots
        else:
            base = lengths - (tree.in_flight - n)
            self.positions = base[:, None] + tree.offsets[tree.in_flight - n:]
        if backend == "varlen":
            self._plan_varlen(cache, lengths)
        else:
            totals = cache.host_lengths + n
            self.runs = [self._run(cache, start, end, key_len, totals)
                         for start, end, key_len in plan_runs(totals, kind)]
        # rows in a few spans of one length each (a batch that started together; a ragged batch's long row
        # among short ones): a slice copy per span, not a scatter, where the device says it pays; elsewhere
        # the scatter from device lengths, which a captured graph can replay
        self.spans = (equal_length_spans(cache.host_lengths, kind.slice_write_spans) if backend != "varlen"
                      else None)

    # ---------------------------------------------------------------- sdpa
    def _run(self, cache: KVCache, start: int, end: int, key_len: int, totals: np.ndarray):
        """(start, end, key_len, mask, window mask) of one run; masks are (rows, 1, n, key_len) or None."""
        padded = not (totals[start:end] == key_len).all()
        if self.tree is None and self.n == 1 and not padded and (not self.window or key_len <= self.window):
            return start, end, key_len, None, None  # every row sees all its keys: no mask
        if padded:
            cache.readable_to(start, end, key_len)  # shorter rows are read (masked) beyond their own keys
        keys = torch.arange(key_len, device=cache.device)
        positions = self.positions[start:end]
        dtype = cache.keys.dtype
        if self.tree is None:
            allowed = _additive(_causal(keys, positions, None)[:, None], dtype)
            windowed = _additive(_causal(keys, positions, self.window)[:, None], dtype) if self.window else allowed
            return start, end, key_len, allowed, windowed
        tree, m = self.tree, self.tree.in_flight
        base = cache.lengths[start:end] - (m - self.n)
        relative = keys - base[:, None]  # (rows, key_len): slot index inside the in-flight region
        inside = (relative >= 0) & (relative < m)
        tree_part = tree.mask[:, relative.clamp(0, m - 1)].permute(1, 0, 2)  # (rows, n, key_len)
        allowed = (relative < 0)[:, None, :] | (inside[:, None, :] & tree_part)
        windowed = allowed
        if self.window:
            key_positions = torch.where(inside, base[:, None] + tree.offsets[relative.clamp(0, m - 1)], keys)
            windowed = allowed & (key_positions[:, None, :] > positions[..., None] - self.window)
        allowed = _additive(allowed[:, None], dtype)
        return start, end, key_len, allowed, (_additive(windowed[:, None], dtype) if self.window else allowed)

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (b, n, kv_heads, head_dim) into each row's next n slots."""
        if self.spans is not None:
            for start, end, slot in self.spans:
                cache.keys[layer, start:end, slot:slot + self.n] = k[start:end]
                cache.values[layer, start:end, slot:slot + self.n] = v[start:end]
            return
        cache.keys[layer][self.rows, self.slots] = k.to(cache.keys.dtype)
        cache.values[layer][self.rows, self.slots] = v.to(cache.values.dtype)

    def attend(self, q: torch.Tensor, cache: KVCache, layer: int, windowed: bool, gqa: bool,
               merge=None) -> torch.Tensor:
        """q (b, n, heads, head_dim) -> the attention output, same layout. `merge`: what attends the in-flight
        tokens and merges them with the prefix on the varlen backend (`in_flight_merge`, or its compiled
        form: runtime.fused)."""
        if self.backend == "varlen":
            return self._attend_varlen(q, cache, layer, windowed, gqa, merge)
        keys, values = cache.keys[layer], cache.values[layer]
        if len(self.runs) == 1:
            start, end, key_len, mask, window_mask = self.runs[0]
            return _sdpa(q, keys[:, :key_len], values[:, :key_len], window_mask if windowed else mask, gqa)
        out = torch.empty_like(q)
        for start, end, key_len, mask, window_mask in self.runs:
            out[start:end] = _sdpa(q[start:end], keys[start:end, :key_len], values[start:end, :key_len],
                                   window_mask if windowed else mask, gqa)
        return out

    # ---------------------------------------------------------------- varlen (CUDA)
    def _plan_varlen(self, cache: KVCache, lengths: torch.Tensor) -> None:
        """The flash calls of this pass (docs/runtime.md, "Decode attention"):
        - one token a row (decode, draft passes, k = 0): one non-causal call (its query sees every key its row
          uses: the same result). Flash then packs each KV head's query group into the query tile and splits
          long key ranges, which it does only when the right window is negative;
        - n >= 2 tokens a row (a verify) and trees: the committed prefix in one non-causal call with each KV
          head's n x group queries packed into the query dimension (a tile holds them all, not n real rows of
          128 per query head), and the in-flight tokens (the pass's own, or the tree's) attended exactly under
          their mask; the two merged by their log-sum-exp;
        - a verify keeps the one causal call where the merge is not fused (the eager layer: its ~20 small
          kernels a layer would cost more than the tile saves at small batches; runtime.fused makes it one
          function) and on a sliding-window layer (each token's window starts at its own position, which a
          packed call over the prefix cannot express)."""
        b, device = cache.batch_size, cache.device
        self.flash = flash_varlen_call(device)
        self.cu_k = (torch.arange(b + 1, device=device) * cache.max_len).int()
        self.cu_q = (torch.arange(b + 1, device=device) * self.n).int()
        self.used_k = (lengths + self.n).int()  # the causal call (n = 1, or a windowed layer's verify)
        self._packed_cu_q: dict[int, torch.Tensor] = {}
        if self.tree is None and self.n == 1:
            return
        m = self.tree.in_flight if self.tree is not None else self.n
        base = lengths - (m - self.n)
        self.prefix_used_k = base.int()  # the committed prefix; the in-flight slots go by hand
        self.in_flight_slots = base[:, None] + torch.arange(m, device=device)  # (b, m)
        self.in_flight_mask = (self.tree.mask if self.tree is not None else
                               torch.ones(self.n, self.n, dtype=torch.bool, device=device).tril())

    def _packed_offsets(self, group: int) -> torch.Tensor:
        """cu_q of the packed prefix call: row r's n x group queries start at r * n * group (planned once per
        pass: every layer reuses it)."""
        if group not in self._packed_cu_q:
            self._packed_cu_q[group] = self.cu_q * group
        return self._packed_cu_q[group]

    def _attend_varlen(self, q, cache: KVCache, layer: int, windowed: bool, gqa: bool, merge) -> torch.Tensor:
        b, n, heads, head_dim = q.shape
        keys, values = cache.keys[layer], cache.values[layer]
        flat_k, flat_v = keys.reshape(-1, *keys.shape[2:]), values.reshape(-1, *values.shape[2:])
        window = _window_of(windowed, self.window)
        if self.n == 1 and self.tree is None:
            out, _ = self.flash(q.reshape(b, heads, head_dim), flat_k, flat_v, self.cu_q, self.cu_k, 1,
                                cache.max_len, self.used_k, window - 1 if window else -1, causal=False)
            return out.view(b, n, heads, head_dim)
        if self.tree is None and (window or merge is None):
            out, _ = self.flash(q.reshape(b * n, heads, head_dim), flat_k, flat_v, self.cu_q, self.cu_k, n,
                                cache.max_len, self.used_k, window - 1 if window else -1)
            return out.view(b, n, heads, head_dim)
        kv_heads = keys.shape[2]
        group = heads // kv_heads
        # (b, n, kv, group, d) -> (b, n, group, kv, d): row r's queries of KV head h are its n x group entries
        packed = q.view(b, n, kv_heads, group, head_dim).transpose(2, 3).reshape(b * n * group, kv_heads, head_dim)
        prefix, prefix_lse = self.flash(packed, flat_k, flat_v, self._packed_offsets(group), self.cu_k, n * group,
                                        cache.max_len, self.prefix_used_k, causal=False)
        return (merge or in_flight_merge)(q, keys, values, self.rows, self.in_flight_slots, self.in_flight_mask,
                                          prefix, prefix_lse)


def in_flight_merge(q, keys, values, rows, slots, mask, prefix, prefix_lse):
    """A verify's (or a tree's) attention: q (b, n, heads, d) over each row's in-flight `slots` (b, m) of the
    cache's `keys` and `values` under `mask` (n, m), merged with the packed prefix call's output
    (b * n * group, kv, d) and log-sum-exp (kv, b * n * group) -> (b, n, heads, d). One function, so that
    runtime.fused compiles it into few kernels."""
    b, n, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    nodes, nodes_lse = _masked_attention(q, keys[rows, slots], values[rows, slots], mask)  # keys (b, m, kv, d)
    prefix = prefix.view(b, n, group, kv_heads, head_dim).transpose(2, 3).reshape(b, n, heads, head_dim)
    # the kernel's log-sum-exp is (heads, tokens) (torch's meta implementation of varlen says so): here
    # (kv, b * n * group) -> (b, n, kv * group), the query heads' order
    prefix_lse = prefix_lse.view(kv_heads, b, n, group).permute(1, 2, 0, 3).reshape(b, n, heads)
    # flash reports a query that saw no key (an empty prefix: a pass on a fresh cache, a spare graph row)
    # with lse +inf; for the merge it is an empty set: -inf
    prefix_lse = prefix_lse.nan_to_num(posinf=float("-inf"))
    return merge_by_lse(prefix, prefix_lse, nodes, nodes_lse)


def _masked_attention(q, k, v, mask):
    """Attention of q (b, n, heads, d) over a few keys k, v (b, m, kv_heads, d) under mask (n, m) shared by
    every row, in float32; returns the output (b, n, heads, d) in q's dtype and the log-sum-exp (b, n, heads)."""
    b, n, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.float().view(b, n, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("bnkgd,bmkd->bkgnm", grouped, k.float()) / math.sqrt(head_dim)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, kv, g, n)
    out = torch.einsum("bkgnm,bmkd->bnkgd", (scores - lse[..., None]).exp(), v.float())
    return out.reshape(b, n, heads, head_dim).to(q.dtype), lse.permute(0, 3, 1, 2).reshape(b, n, heads)


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint sets of keys, each normalised over its own, as attention over both:
    weights exp(lse_x - lse) with lse = log(exp(lse_a) + exp(lse_b)). A set with no keys has lse -inf."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    weight_a = torch.nan_to_num((lse_a.float() - lse).exp())[..., None]
    weight_b = torch.nan_to_num((lse_b.float() - lse).exp())[..., None]
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


class RaggedPass:
    """Row r feeds counts[r] tokens, packed one row after another, on top of its cached tokens (none, for
    a prefill); causal. The layout is planned on the host and uploaded once."""

    def __init__(self, cache: KVCache, counts: list[int], window: int | None, backend: str):
        device = cache.device
        kind = device_kind(device)
        self.counts, self.window, self.backend = list(counts), window, backend
        starts = cache.host_lengths.copy()
        cumulative = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        total = int(cumulative[-1])
        row_of_token = np.repeat(np.arange(len(counts)), counts)
        position = starts[row_of_token] + np.arange(total) - cumulative[row_of_token]
        self.cumulative = cumulative
        self.ends = starts + np.asarray(counts, dtype=np.int64)  # each row's length after the pass
        self.last_token = upload(cumulative[1:] - 1, device)  # each row's last token in the packing
        layout = upload(np.stack([row_of_token, position]), device)
        self.row_of_token, self.positions = layout[0], layout[1]
        if backend == "varlen":
            self.cu_q = upload(cumulative, device, torch.int32)
            self.cu_k = (torch.arange(len(counts) + 1, device=device) * cache.max_len).int()
            self.used_k = upload(self.ends, device, torch.int32)
            self.max_q = max(counts)
            self.flash = flash_varlen_call(device)
            return
        self.groups, self.alone = [], []  # fresh rows padded together; rows continuing their cache, one by one
        fresh = [r for r in range(len(counts)) if starts[r] == 0]
        continuing = [r for r in range(len(counts)) if starts[r] > 0]
        alone_tokens = kind.alone_prefill_tokens
        for group in prefill_groups([counts[r] for r in fresh], kind.prefill_padding):
            rows = [fresh[i] for i in group]
            longest = counts[rows[0]]
            steps = np.arange(longest)
            # token gathered at (row, i): the row's i-th, padding repeats its last (never attended to)
            gather = cumulative[rows][:, None] + np.minimum(steps, np.asarray([counts[r] for r in rows])[:, None] - 1)
            valid = steps[None, :] < np.asarray([counts[r] for r in rows])[:, None]
            first = int(gather[0, 0])
            if valid.all() and np.array_equal(gather.ravel(), np.arange(first, first + gather.size)):
                # rows of one length, packed one after another (a uniform batch): a view, no gathered copies
                self.groups.append((None, None, slice(first, first + gather.size), longest))
                continue
            if alone_tokens is not None and longest > alone_tokens:  # a call per row, from the packing: no copies
                self.groups += [(None, None, slice(int(cumulative[r]), int(cumulative[r + 1])), counts[r])
                                for r in rows]
                continue
            self.groups.append((upload(gather, device), upload(np.flatnonzero(valid), device),
                                upload(gather[valid], device), longest))
        for row in continuing:
            keys = torch.arange(int(starts[row]) + counts[row], device=device)
            own = self.positions[int(cumulative[row]):int(cumulative[row + 1])]
            self.alone.append((row, int(starts[row]) + counts[row], _causal(keys, own, None)[None, None],
                               _causal(keys, own, window)[None, None] if window else None))

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (tokens, kv_heads, head_dim) into each token's row and position."""
        cache.keys[layer][self.row_of_token, self.positions] = k.to(cache.keys.dtype)
        cache.values[layer][self.row_of_token, self.positions] = v.to(cache.values.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, windowed: bool,
               gqa: bool) -> torch.Tensor:
        """q, k, v (tokens, heads, head_dim) of this pass -> the attention output (tokens, heads, head_dim)."""
        window = _window_of(windowed, self.window)
        if self.backend == "varlen":
            keys, values = cache.keys[layer], cache.values[layer]
            out, _ = self.flash(q, keys.reshape(-1, *keys.shape[2:]), values.reshape(-1, *values.shape[2:]),
                                self.cu_q, self.cu_k, self.max_q, cache.max_len, self.used_k,
                                window - 1 if window else -1)
            return out
        out = torch.empty_like(q)
        for gather, valid, tokens, longest in self.groups:
            mask = None
            if window and longest > window:  # the causal window, the same for every row of the group
                steps = torch.arange(longest, device=q.device)
                mask = _causal(steps, steps, window)
            if gather is None:  # `tokens` is the group's span of the packing
                shaped = [x[tokens].reshape(-1, longest, *x.shape[1:]) for x in (q, k, v)]
                rows = _sdpa(*shaped, mask, gqa, causal=True)
                out[tokens] = rows.reshape(-1, *rows.shape[2:])
                continue
            rows = _sdpa(q[gather], k[gather], v[gather], mask, gqa, causal=True)  # (rows, longest, heads, d)
            out[tokens] = rows.reshape(-1, *rows.shape[2:])[valid]
        for row, key_len, mask, window_mask in self.alone:
            span = slice(int(self.cumulative[row]), int(self.cumulative[row + 1]))
            out[span] = _sdpa(q[None, span], cache.keys[layer, row:row + 1, :key_len],
                              cache.values[layer, row:row + 1, :key_len], window_mask if window else mask, gqa)[0]
        return out
