"""CUDA graphs for decode and verify passes (runtime.cuda_graphs).

On the CPU, the bookkeeping around the graphs (buckets, static inputs, spare rows, the host's lengths)
runs with a stand-in capture that replays the captured function the way a graph replays its kernels:
the device work again, the host's side not at all. On a GPU (marked), the real graphs: their logits
against eager passes, and generation against target-only greedy output."""
from __future__ import annotations

import pytest
import torch

from specbatch.runtime import cuda_graphs
from specbatch.runtime.cuda_graphs import GraphedModel, bucket_for
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK


def replaying_capture(log):
    """A capture whose replay reruns the pass's device work and leaves the host untouched, as a graph does."""

    def capture(run, reset, cache, pool):
        reset()
        output = run()
        output = None if output is None else output.clone()
        log.append(None if output is None else output.shape)

        def replay():
            host = cache.root.host_lengths.copy()
            fresh = run()
            if output is not None:
                output.copy_(fresh)
            cache.root.host_lengths[:] = host

        return replay, output, None

    return capture


def test_buckets():
    assert [bucket_for(b, 256) for b in (1, 3, 5, 17, 33, 200, 256)] == [1, 4, 8, 24, 48, 224, 256]
    assert bucket_for(7, 6) == 6


def test_graphed_passes_give_the_eager_logits_and_lengths(greedy_target, prompts8, backend, monkeypatch):
    if backend != "varlen":
        pytest.skip("graphs replay varlen passes only")
    monkeypatch.setattr(greedy_target, "attention_backend", "varlen")
    captured = []
    graphed = GraphedModel(greedy_target, capture=replaying_capture(captured))
    eager_cache, graphed_cache = greedy_target.new_cache(8, 64), greedy_target.new_cache(8, 64)
    with torch.no_grad():
        for cache in (eager_cache, graphed_cache):
            greedy_target(torch.tensor([t for p in prompts8 for t in p]), cache, last=1,
                          new_tokens=[len(p) for p in prompts8])
        rows = torch.randint(0, 64, (5, 3), generator=torch.Generator().manual_seed(0))
        for step in range(3):  # three passes of 3 tokens over rows 0..4 (bucket 8: rows 5..7 spare)
            eager = greedy_target(rows, eager_cache.rows(0, 5))
            ours = graphed(rows, graphed_cache.rows(0, 5))
            torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
            assert graphed_cache.host_lengths[:5].tolist() == eager_cache.host_lengths[:5].tolist()
            assert torch.equal(graphed_cache.lengths[:5], eager_cache.lengths[:5])
            assert graphed_cache.host_lengths[5:].tolist() == graphed_cache.lengths[5:].tolist() == [3, 3, 3]
        assert len(captured) == 1 and captured[0][0] == 8  # one graph, for the bucket of 8
        graphed(rows[:2, :1], graphed_cache.rows(0, 2), last=1)
        assert len(captured) == 2 and captured[1][:2] == (2, 1)


def test_generation_with_graphs_is_lossless(greedy_target, greedy_draft_sometimes, prompts8, monkeypatch):
    for model in (greedy_target, greedy_draft_sometimes):
        monkeypatch.setattr(model, "attention_backend", "varlen")
    import varlen_reference

    varlen_reference.use_reference_flash(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", replaying_capture([]))
    expected = SpeculativeGenerator(greedy_target, None).generate(prompts8, 12, FixedK(0)).token_ids
    for k in (0, 3):
        generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, cuda_graphs=True)
        assert generator.generate(prompts8, 12, FixedK(k)).token_ids == expected


@pytest.mark.gpu
def test_cuda_graphs_match_eager_on_a_gpu(greedy_target, greedy_draft_sometimes, prompts8):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = greedy_target.to("cuda", torch.bfloat16)
    draft = greedy_draft_sometimes.to("cuda", torch.bfloat16)
    try:
        eager = SpeculativeGenerator(target, draft).generate(prompts8, 12, FixedK(3)).token_ids
        graphed = SpeculativeGenerator(target, draft, cuda_graphs=True).generate(prompts8, 12, FixedK(3)).token_ids
        assert graphed == eager
    finally:
        greedy_target.to("cpu", torch.float32), greedy_draft_sometimes.to("cpu", torch.float32)
