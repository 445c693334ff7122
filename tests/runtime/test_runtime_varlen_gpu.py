"""The varlen backend on a GPU (marked; skipped without CUDA): the real kernel against the CPU reference the
other tests run the backend's code through (its contract: offsets, key counts, causal alignment, windows,
the log-sum-exp's layout), and whole passes against the sdpa backend on the same GPU."""
from __future__ import annotations

import pytest
import torch
from torch_fixtures import moved

import varlen_reference

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0)])
def test_the_kernel_keeps_the_references_contract(window):
    """Our flash call (runtime.devices.cuda: aten's op, as resolved on this torch) against the reference."""
    from specbatch.runtime.devices import cuda as cuda_device

    found = cuda_device.flash_varlen("cuda")
    assert found.attend is not None, found.reason
    generator = torch.Generator().manual_seed(0)
    rows, max_len, heads, kv_heads, dim = 3, 32, 8, 2, 64
    used = torch.tensor([5, 32, 17], dtype=torch.int32)
    per_row_q = [1, 4, 3]
    q = torch.randn(sum(per_row_q), heads, dim, generator=generator)
    k = torch.randn(rows * max_len, kv_heads, dim, generator=generator)
    v = torch.randn(rows * max_len, kv_heads, dim, generator=generator)
    cu_q = torch.tensor([0, 1, 5, 8], dtype=torch.int32)
    cu_k = torch.arange(rows + 1, dtype=torch.int32) * max_len
    expected, expected_lse = varlen_reference.varlen_attn(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 4, max_len, return_aux=varlen_reference.AuxRequest(True),
        window_size=window, enable_gqa=True, seqused_k=used)
    left, right = window
    got, lse = found.attend(q.bfloat16().cuda(), k.bfloat16().cuda(), v.bfloat16().cuda(), cu_q.cuda(), cu_k.cuda(), 4,
                            max_len, used.cuda(), left, causal=right == 0)
    torch.testing.assert_close(got.float().cpu(), expected.float(), atol=2e-2, rtol=2e-2)
    assert lse.shape == expected_lse.shape  # (heads, tokens): what the tree merge reads
    torch.testing.assert_close(lse.float().cpu(), expected_lse, atol=2e-2, rtol=2e-2)


@cuda
def test_a_pass_gives_the_same_logits_on_both_backends(greedy_target, prompts8):
    from specbatch.perfmodel.tree import parse_tree
    from specbatch.runtime.attention import TreeAttention
    from specbatch.runtime.tree_decoding import plan_for

    model = moved(greedy_target, "cuda", torch.bfloat16)
    try:
        counts = [len(p) for p in prompts8]
        packed = torch.tensor([t for p in prompts8 for t in p], device="cuda")
        step = torch.randint(0, 64, (8, 4), device="cuda")
        tree = parse_tree("0,1,2,0.0,0.1,1.0")
        plan = plan_for(tree, torch.device("cuda"))
        nodes = torch.randint(0, 64, (8, tree.num_nodes + 1), device="cuda")
        outputs = {}
        for backend in ("sdpa", "varlen"):
            model.attention_backend = backend
            cache = model.new_cache(8, 64)
            with torch.no_grad():
                first = model(packed, cache, last=1, new_tokens=counts)
                chain = model(step, cache)
                tree_logits = model(nodes, cache, TreeAttention(plan.depths, plan.target_mask))
            outputs[backend] = (first.float(), chain.float(), tree_logits.float())
        for ours, theirs in zip(outputs["varlen"], outputs["sdpa"]):
            torch.testing.assert_close(ours, theirs, atol=5e-2, rtol=5e-2)
    finally:
        model.attention_backend = None
        moved(greedy_target, "cpu", torch.float32)
