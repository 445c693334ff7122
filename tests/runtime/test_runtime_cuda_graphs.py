"""CUDA graphs for decode and verify passes (runtime.cuda_graphs).

On the CPU, the bookkeeping around the graphs (buckets, static inputs, spare rows, the host's lengths)
runs with a stand-in capture that replays the captured function the way a graph replays its kernels:
the device work again, the host's side not at all. On a GPU (marked), the real graphs: their logits
against eager passes, and generation against target-only greedy output."""
from __future__ import annotations

import gc

import pytest
import torch

from specbatch.runtime import cuda_graphs
from specbatch.runtime.cuda_graphs import GraphedModel, bucket_for
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from torch_fixtures import moved

from test_runtime_engine import solo_greedy


def stand_in_graphs(monkeypatch, models) -> list:
    """`models` on the varlen backend (its CPU reference kernel) with the stand-in capture; the captures'
    output shapes are logged in the list returned."""
    import varlen_reference

    for model in models:
        monkeypatch.setattr(model, "attention_backend", "varlen")
    varlen_reference.use_reference_flash(monkeypatch)
    log = []
    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", replaying_capture(log))
    return log


@pytest.fixture
def graphed_on_cpu(greedy_target, greedy_draft_sometimes, monkeypatch):
    """Both models graphed on the CPU through the stand-in capture (`stand_in_graphs`)."""
    return stand_in_graphs(monkeypatch, (greedy_target, greedy_draft_sometimes))


def replaying_capture(log):
    """A capture whose replay reruns the pass's device work and leaves the host untouched, as a graph does."""

    def capture(run, reset, cache, pool):
        reset()
        output = run()
        log.append(tuple(_shape(part) for part in output) if isinstance(output, tuple) else _shape(output))

        def replay():
            host = cache.root.host_lengths.copy()
            fresh = run()
            for captured, now in zip(_parts(output), _parts(fresh)):
                if captured is not None and now is not captured:  # a graph writes where it wrote when captured
                    captured.copy_(now)
            cache.root.host_lengths[:] = host

        return replay, output, None

    return capture


def _shape(output):
    return None if output is None else output.shape


def _parts(output) -> tuple:
    return output if isinstance(output, tuple) else (output,)


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
            # spare rows 5..7 keep what they hold (their prompts): lengths as the eager cache's, never advanced
            assert graphed_cache.host_lengths[5:].tolist() == graphed_cache.lengths[5:].tolist() \
                == eager_cache.host_lengths[5:].tolist() == [len(p) for p in prompts8[5:]]
        # the bucket of 8 and every smaller one at that width (a batch shrinks through them)
        assert [shape[0] for shape in captured] == [1, 2, 4, 8]
        assert graphed.stats()["kept"] == 4
        graphed(rows[:2, :1], graphed_cache.rows(0, 2), last=1)
        assert len(captured) == 6 and captured[-1][:2] == (2, 1)
        del graphed_cache, cache
        gc.collect()  # the stand-in's replay refers to its cache: a cycle
        assert graphed.stats() == {"captures": 6, "capture_s": graphed.capture_s, "kept": 0}  # gone with the cache


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


def test_a_prompt_prefilled_in_parts_beside_graphed_steps_stays_intact(greedy_target, greedy_draft_sometimes,
                                                                       prompts8, graphed_on_cpu):
    """Three running rows step in the bucket of 4 while a long prompt is prefilled in parts in row 3 (a spare
    row of that bucket): every request gets its solo greedy tokens."""
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, cuda_graphs=True)
    requests, got = serve_beside_a_part_prefill(generator, prompts8, max_tokens=(24, 10))
    assert any(shape[0] == 4 for shape in graphed_on_cpu if shape is not None)  # row 3 was spare in a graph
    for request in requests:
        assert got[request.id] == solo_greedy(greedy_target, list(request.prompt_ids), request.max_tokens), \
            request.id


def serve_beside_a_part_prefill(generator, prompts8, max_tokens: tuple[int, int]):
    """Three requests step in a batch of 4 while a fourth, long prompt (5 parts of 8 tokens and a last one of
    5) is prefilled in parts in row 3; max_tokens: (the three's, the long one's). The requests, and the tokens
    each received."""
    from specbatch.runtime.engine import Engine, EngineConfig, Request

    engine = Engine(generator, FixedK(2), EngineConfig(max_batch_size=4, prefill_chunk_tokens=8))
    timeline = []
    requests = [Request(name, tuple(prompt), max_tokens[0], on_event=timeline.append)
                for name, prompt in (("a", prompts8[0]), ("b", prompts8[2]), ("c", prompts8[6]))]
    requests.append(Request("long", tuple((prompts8[4] * 3)[:45]), max_tokens[1], on_event=timeline.append))
    for request in requests[:3]:
        engine.submit(request)
    engine.step()
    engine.submit(requests[3])
    while engine.step():
        pass
    return requests, {r.id: [t for e in timeline if e.request_id == r.id for t in e.token_ids] for r in requests}


@pytest.mark.gpu
def test_cuda_graphs_match_eager_on_a_gpu(greedy_target, greedy_draft_sometimes, prompts8):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = moved(greedy_target, "cuda", torch.bfloat16)
    draft = moved(greedy_draft_sometimes, "cuda", torch.bfloat16)
    try:
        eager = SpeculativeGenerator(target, draft, cuda_graphs=False).generate(prompts8, 12, FixedK(3)).token_ids
        graphed = SpeculativeGenerator(target, draft, cuda_graphs=True).generate(prompts8, 12, FixedK(3)).token_ids
        assert graphed == eager
    finally:
        moved(greedy_target, "cpu", torch.float32), moved(greedy_draft_sometimes, "cpu", torch.float32)


def test_bench_rounds_capture_only_while_warming_up(greedy_target, greedy_draft_sometimes, prompts8, graphed_on_cpu):
    """Bench's rounds simulated: contenders in lockstep (calibrate.lockstep) in each round's rotated order
    (bench.plan.balanced_order), synthetic acceptance drawn anew each round (rows finish at other steps).
    After the warm-up round no cache is made and nothing is captured, and the graphs kept stay as many."""
    from specbatch.bench.plan import balanced_order
    from specbatch.calibrate.lockstep import run_lockstep

    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, cuda_graphs=True)
    policies = {"k0": FixedK(0), "k2": FixedK(2), "k3": FixedK(3)}
    after_warmup = None
    for round_index in range(-1, 4):
        prompts = [p[:len(p) - (round_index + 1) % 3] for p in prompts8[:6]]  # other lengths each round
        run_lockstep({name: generator.generation(prompts, 14, policies[name], seed=round_index,
                                                 synthetic_acceptance=0.7)
                      for name in balanced_order(list(policies), round_index)})
        if round_index == -1:
            after_warmup = generator.graph_stats(), generator._spare_caches.made
            assert after_warmup[0]["captures"] > 0
        else:
            assert (generator.graph_stats(), generator._spare_caches.made) == after_warmup, round_index
    from specbatch.bench.rounds import graph_notes

    stats = generator.graph_stats()
    assert graph_notes(generator, 0) == [f"CUDA graphs: {stats['captures']} captured in {stats['capture_s']:.2f} s "
                                         f"(warm-up rounds, not timed), {stats['kept']} kept"]
    assert "2 CUDA graph(s) were captured inside timed rounds" in graph_notes(generator, 2)[1]
    assert graph_notes(SpeculativeGenerator(greedy_target), 0) == []  # eager: nothing to say


def test_the_graphs_of_every_cache_share_one_logits_buffer_per_bucket_and_width(greedy_target, prompts8,
                                                                               graphed_on_cpu):
    """Two caches (two lockstep generations) graph the same passes: one buffer per (bucket, width, logits
    kept), written by both caches' graphs, each replay still giving its own cache's logits."""
    graphed = GraphedModel(greedy_target)
    caches = [greedy_target.new_cache(4, 32) for _ in range(4)]  # two graphed, two eager twins
    batches = (prompts8[:4], prompts8[4:], prompts8[:4], prompts8[4:])
    with torch.no_grad():
        for cache, prompts in zip(caches, batches):
            greedy_target(torch.tensor([t for p in prompts for t in p]), cache, last=1,
                          new_tokens=[len(p) for p in prompts])
        tokens = torch.tensor([[1, 2], [3, 4], [5, 6]])
        for step in range(2):
            outputs = []
            for graphed_cache, eager_cache in zip(caches[:2], caches[2:]):
                outputs.append(graphed(tokens, graphed_cache.rows(0, 3)))
                torch.testing.assert_close(outputs[-1], greedy_target(tokens, eager_cache.rows(0, 3)))
            assert outputs[0].data_ptr() == outputs[1].data_ptr()  # one buffer
    assert sorted(graphed.buffers) == [("logits", 1, 2, None), ("logits", 2, 2, None), ("logits", 4, 2, None)]
    assert graphed.stats()["kept"] == 6  # but each cache its own graphs


@pytest.mark.gpu
def test_graphed_serving_and_sampling_match_eager_on_a_gpu(greedy_target, greedy_draft_sometimes, prompts8):
    """Real graphs: an engine prefilling a long prompt in parts beside graphed steps gives every request the
    tokens the eager engine gives, and a sampled generation draws the same tokens graphed and eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specbatch.runtime.sampling import Sampling

    target = moved(greedy_target, "cuda", torch.bfloat16)
    draft = moved(greedy_draft_sometimes, "cuda", torch.bfloat16)
    try:
        got = {graphs: serve_beside_a_part_prefill(SpeculativeGenerator(target, draft, cuda_graphs=graphs), prompts8,
                                                   max_tokens=(16, 16))[1] for graphs in (False, True)}
        assert got[True] == got[False]
        sampled = [SpeculativeGenerator(target, draft, cuda_graphs=graphs).generate(
            prompts8, 12, FixedK(3), Sampling(temperature=1.0), seed=5).token_ids for graphs in (False, True)]
        assert sampled[0] == sampled[1]
    finally:
        moved(greedy_target, "cpu", torch.float32), moved(greedy_draft_sometimes, "cpu", torch.float32)


def test_the_gpu_tests_move_models_keeping_float32_rope_tables(greedy_target):
    """The GPU tests move the fixtures to bfloat16 and back (`moved`): the RoPE tables stay float32 and exact, as
    the product makes them (a plain `.to(bfloat16)` rounds them, and moving back keeps the rounding)."""
    before = greedy_target.inv_freq.clone()
    try:
        moved(greedy_target, "cpu", torch.bfloat16)
        assert greedy_target.inv_freq.dtype == torch.float32 and torch.equal(greedy_target.inv_freq, before)
    finally:
        moved(greedy_target, "cpu", torch.float32)
    assert torch.equal(greedy_target.inv_freq, before)


def test_a_draft_models_graph_keys_stay_bounded_after_steps_at_k0(greedy_target, greedy_draft_sometimes, prompts8,
                                                                    graphed_on_cpu):
    """Steps at k = 0 leave the draft behind; its catch-up then feeds every token it lacks. Passes wider than
    DRAFT_GRAPH_MAX_WIDTH run eagerly: the draft's graphs are of widths 1 and 2 only (what the memory plan
    counts), however long the lag, and the output stays the target's."""
    from specbatch.runtime.cuda_graphs import DRAFT_GRAPH_MAX_WIDTH, graphs_of

    class FiveAtZeroThenThree:
        max_k, calls = 3, 0

        def __call__(self, batch_size, context_len=None):
            self.calls += 1
            return 0 if self.calls % 6 else 3  # five steps at k = 0, then one of 3: a catch-up of 6 or so

        def describe(self):
            return "k=0 five steps, then 3"

    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, cuda_graphs=True)
    prompts = prompts8[:5]
    result = generator.generate(prompts, 30, FiveAtZeroThenThree())
    assert result.token_ids == [solo_greedy(greedy_target, p, 30) for p in prompts]
    widths = {key[1] for root in generator.draft_runner.roots for key in graphs_of(root)}
    assert widths and max(widths) <= DRAFT_GRAPH_MAX_WIDTH == 2
    assert max(result.stats.k_per_step) == 3 and result.stats.k_per_step.count(0) >= 10


def test_capture_buckets_cover_every_batch_a_cache_replays():
    for capacity in (1, 5, 20, 64, 300):
        buckets = cuda_graphs.capture_buckets(capacity)
        assert buckets == sorted(buckets, reverse=True)  # largest first: smaller graphs reuse its pool
        assert {bucket_for(b, capacity) for b in range(1, capacity + 1)} == set(buckets)


class ByBatch:
    """k = batch size mod 4: as rows join and leave, every k of 0..3 runs at several batch sizes."""

    max_k = 3

    def __call__(self, batch_size, context_len=None):
        return batch_size % 4

    def describe(self):
        return "k = batch size mod 4"


def _bucket_of(logged) -> int:
    """The bucket of a stand-in capture's logged output shape (a shape, or a tuple of them and None)."""
    parts = logged if isinstance(logged, tuple) and not isinstance(logged, torch.Size) else (logged,)
    return next(part[0] for part in parts if part is not None)


def served_after_capturing_ahead(generator, prompts, captured: list) -> None:
    """An engine over `generator` captures at start-up, largest bucket first; then five requests join one by one
    and leave at different steps (batches 1..5 over buckets 1, 2, 4 and 5, k varying 0..3) and not one capture
    happens while serving."""
    from specbatch.runtime.engine import Engine, EngineConfig, Request

    engine = Engine(generator, ByBatch(), EngineConfig(max_batch_size=5))
    ahead = generator.graph_stats()["captures"]
    assert engine.graphs_captured == ahead == len(captured) > 0
    assert _bucket_of(captured[0]) == 5  # the largest bucket first
    events = []
    for index, prompt in enumerate(prompts[:5]):
        engine.submit(Request(f"r{index}", tuple(prompt), 6 + 3 * index, on_event=events.append))
        engine.step()
    while engine.step():
        pass
    assert generator.graph_stats()["captures"] == ahead  # none while serving
    assert {e.request_id for e in events if e.finish_reason} == {f"r{i}" for i in range(5)}


def test_a_server_captures_every_graph_before_its_first_request(greedy_target, greedy_draft_sometimes, prompts8,
                                                                 graphed_on_cpu):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, cuda_graphs=True)
    served_after_capturing_ahead(generator, prompts8, graphed_on_cpu)
