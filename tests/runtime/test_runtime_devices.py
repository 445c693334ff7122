"""The device seam (runtime.devices): one record per device kind, the only place that compares device types,
and a flash varlen call resolved from the op's schema and a trial call (torch 2.10 to 2.13)."""
from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch

import varlen_reference
from specbatch.perfmodel.errors import UsageError
from specbatch.runtime import devices
from specbatch.runtime.attention import equal_length_spans, plan_runs, prefill_groups
from specbatch.runtime.devices import DeviceKind, cuda, device_kind
from specbatch.runtime.devices.cpu import CPU

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"
DEVICE_BRANCH = re.compile(r"\.type\s*(==|!=|\bin\b)|[!=]=\s*[\"']c(pu|uda)[\"']|\bis_cuda\b|\.is_cpu\b")
# the CPU-tuned numbers that used to be module constants of the shared runtime
RETIRED = ("CALL_KEYS", "ROW_KEYS", "SLICE_WRITES", "PREFILL_PADDING", "ALONE_PREFILL_TOKENS", "CPU_PREFILL_TOKENS",
           "ZEROED_SLOTS", "HOST_BOOKKEEPING_MAX_CELLS")


def test_no_device_type_branch_outside_the_seam():
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if "devices" in path.relative_to(RUNTIME).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if DEVICE_BRANCH.search(code) or any(re.search(rf"\b{name}\b", code) for name in RETIRED):
                found.append(f"{path.relative_to(RUNTIME)}:{number}: {line.strip()}")
    assert not found, "device-type branches or device-tuned constants outside runtime/devices:\n" + "\n".join(found)


def test_every_fitted_number_says_where_it_came_from():
    for kind in devices.KINDS.values():
        for name, value in vars(kind).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert kind.sources.get(name), (kind.name, name)
    with pytest.raises(ValueError, match="no source given for prefill_padding"):
        replace(CPU, sources={k: v for k, v in CPU.sources.items() if k != "prefill_padding"})


def test_the_cuda_record_plans_no_cpu_tuned_path():
    """What a pass on CUDA reads is CUDA's record: one sdpa call padded to the longest row, the scatter
    (capturable) for cache writes, one prefill group and one prefill pass, no host bookkeeping, no lazy cache."""
    kind = device_kind(torch.device("cuda", 0))
    assert kind is devices.KINDS["cuda"] and device_kind("cuda:1") is kind
    totals = np.array([21, 517, 21, 21])
    assert plan_runs(totals, CPU) == [(0, 1, 21), (1, 2, 517), (2, 4, 21)]  # the CPU cuts a far longer row out
    assert plan_runs(totals, kind) == [(0, 4, 517)]
    assert equal_length_spans(np.array([9, 6, 6]), CPU.slice_write_spans) == [(0, 1, 9), (1, 3, 6)]
    assert equal_length_spans(np.array([9, 6, 6]), kind.slice_write_spans) is None
    assert prefill_groups([16, 512, 16, 15], kind.prefill_padding) == [[1, 0, 2, 3]]
    assert (kind.prefill_pass_tokens, kind.host_bookkeeping_max_cells, kind.alone_prefill_tokens) == (None, 0, None)
    assert not kind.lazy_cache and not kind.transposed_projections and kind.graphs_by_default
    assert kind.default_dtype == "bfloat16" and CPU.default_dtype == "float32"
    cpu_numbers = {f.name: getattr(CPU, f.name) for f in fields(DeviceKind) if f.name in CPU.sources}
    assert all(getattr(kind, name) != value for name, value in cpu_numbers.items()), "a CPU number on CUDA"


def test_an_unknown_device_kind_is_one_line():
    with pytest.raises(UsageError, match="runs on cpu, cuda, not mps"):
        device_kind("mps")
    with pytest.raises(UsageError, match="not one of cpu, cuda, cuda:N"):
        devices.resolve_device("tpu")


def _flash_2_9(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
               scale=None):
    """The schema before torch 2.10: no per-row key counts, no window."""
    raise AssertionError("never called")


def test_the_flash_call_is_taken_only_where_the_schema_has_what_it_needs():
    old = cuda.varlen_from(_flash_2_9)
    assert old.attend is None and "seqused_k, window_size_left, window_size_right" in old.reason
    assert cuda.varlen_from(None).attend is None
    assert cuda.varlen_from(varlen_reference.flash_attention_forward).attend is not None
    # this machine's torch: its aten op has the schema (torch >= 2.10) ...
    real = cuda.varlen_from(torch.ops.aten._flash_attention_forward)
    assert real.attend is not None, real.reason
    # ... but no flash kernel on the CPU: a trial call says unusable, where importing would have said fine
    tried = cuda._trial(real, torch.device("cpu"))
    assert tried.attend is None and tried.reason.startswith("a trial call failed")


@pytest.mark.parametrize("window", [None, 5])
def test_the_flash_call_attends_like_the_documented_varlen_contract(window):
    """Through the aten-schema stand-in, our call (GQA natively, each row's used keys, a left window, the
    tree's non-causal prefix with its log-sum-exp) equals torch's public contract (the CPU reference)."""
    torch.manual_seed(0)
    attend = cuda.varlen_from(varlen_reference.flash_attention_forward).attend
    heads, kv_heads, d, slots = 4, 2, 8, 16
    used = torch.tensor([11, 4, 16], dtype=torch.int32)
    n = 3
    q = torch.randn(3 * n, heads, d)
    k, v = torch.randn(3 * slots, kv_heads, d), torch.randn(3 * slots, kv_heads, d)
    cu_q = (torch.arange(4) * n).int()
    cu_k = (torch.arange(4) * slots).int()
    left = window - 1 if window else -1
    out, _ = attend(q, k, v, cu_q, cu_k, n, slots, used, left)
    expected = varlen_reference.varlen_attn(q, k, v, cu_q, cu_k, n, slots, window_size=(left, 0), enable_gqa=True,
                                            seqused_k=used)
    torch.testing.assert_close(out, expected)
    prefix, lse = attend(q, k, v, cu_q, cu_k, n, slots, used, causal=False)
    full, full_lse = varlen_reference.varlen_attn(q, k, v, cu_q, cu_k, n, slots, enable_gqa=True, seqused_k=used,
                                                  return_aux=varlen_reference.AuxRequest(True))
    torch.testing.assert_close(prefix, full)
    torch.testing.assert_close(lse, full_lse)


def test_an_unusable_varlen_falls_back_to_sdpa_with_one_note(monkeypatch, caplog):
    monkeypatch.setattr(cuda, "_resolved", {})
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", _flash_2_9, raising=False)
    with caplog.at_level("WARNING", logger="specbatch.runtime"):
        assert cuda.attention_backend(True, "cuda:0") == "sdpa"
        assert cuda.attention_backend(True, "cuda:0") == "sdpa"
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "passes run on sdpa" in notes[0] and "torch >= 2.10" in notes[0]
    assert devices.attention_backend("cpu", torch.bfloat16) == "sdpa"
