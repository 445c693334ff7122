"""The record of one device kind (runtime.devices): how the runtime runs there, and where each fitted number
came from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class DeviceKind:
    """How the runtime runs on one kind of device. Counts are in tokens, keys or slots, as named."""

    name: str
    default_dtype: str  # when --dtype is auto
    asynchronous: bool  # work is queued: time it with events, stage uploads in pinned memory, never read back mid-step
    lazy_cache: bool  # KV caches start uninitialised; only the slots a padded pass reads are zeroed
    cache_zero_ahead_slots: int  # a lazy cache zeroes ahead in multiples of this many slots
    transposed_projections: bool  # linear weights stored (in, out)-contiguous (runtime.model.lay_out_for_matmul)
    prefill_pass_tokens: int | None  # a prefill runs in passes of whole rows of at most this many tokens; None: one
    host_bookkeeping_max_cells: int  # greedy tree steps of at most this many (row, node) cells keep their
    # drafting bookkeeping on the host, a read-back a round; 0: never
    # the sdpa backend (runtime.attention): a call over `rows` rows spanning `keys` keys costs
    # sdpa_call_keys + rows * (sdpa_row_keys + keys) row-keys; None: one call, every row padded to the longest
    sdpa_call_keys: int | None
    sdpa_row_keys: int | None
    slice_write_spans: int  # a pass writes the cache by slice copies when rows fall in at most this many spans of
    # one length each (else one scatter); 0: always the scatter, which a captured graph replays
    prefill_padding: float  # a fresh prefill's rows are padded together up to this factor over their own tokens
    alone_prefill_tokens: int | None  # ... and gathered into a padded batch only up to this length; None: always
    graphs_by_default: bool  # decode, draft and verify passes replay captured graphs unless --eager
    fused_layers: bool  # cache passes run a layer's small tensor work as compiled kernels (runtime.fused)
    grouped_expert_products: bool  # a mixture-of-experts layer multiplies its experts in one grouped GEMM
    # (torch._grouped_mm, in bfloat16, nothing read back) rather than expert by expert (runtime.experts.RoutedExperts)
    sources: Mapping[str, str] = field(default_factory=dict)  # fitted field -> where its value came from

    def __post_init__(self):
        fitted = {"cache_zero_ahead_slots", "prefill_pass_tokens", "host_bookkeeping_max_cells", "sdpa_call_keys",
                  "sdpa_row_keys", "slice_write_spans", "prefill_padding", "alone_prefill_tokens"}
        missing = sorted(fitted - set(self.sources))
        if missing:
            raise ValueError(f"device kind {self.name}: no source given for {', '.join(missing)}")
