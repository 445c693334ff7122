"""CUDA graphs for a draft head's passes and the target's verify with features (runtime.cuda_graphs.GraphedHead).

On the CPU through the stand-in capture of test_runtime_cuda_graphs (a replay reruns the pass's device work and
leaves the host alone). Oracles: target-only greedy output and the eager run (tokens and acceptance), the eager
passes' outputs and lengths, the buffers the runtime allocates (against calibrate.memory's count), the captures
calibration's ForwardTimer makes before its samples; on a GPU (marked), the real graphs against eager passes in
bfloat16.
"""
from __future__ import annotations

import pytest
import torch

from specbatch.runtime.cuda_graphs import GraphedHead, GraphedModel
from specbatch.runtime.generator import SpeculativeGenerator
from torch_fixtures import moved

from lossless_helpers import naive_greedy
from test_runtime_cuda_graphs import stand_in_graphs
from test_runtime_heads import _prompts
from test_runtime_heads import eagle_head as head, target  # noqa: F401 - the same target and head, shared

KS = (2, 0, 4, 1, 3)  # a step's k, in turn: every width of every pass, drafting passes (k >= 2) or none


class TurningK:
    """A policy whose k changes every step, through KS."""

    max_k = 4

    def __init__(self):
        self.calls = 0

    def __call__(self, batch_size, context_len=None):
        self.calls += 1
        return KS[(self.calls - 1) % len(KS)]

    def describe(self):
        return "k in turn " + ",".join(map(str, KS))


EOS = (61, 30, 19)  # tokens greedy rows reach at different steps: of 8 rows 6 leave (after 2 to 8 tokens), of 3 two


def until_eos(tokens: list[int]) -> list[int]:
    ends = [i for i, token in enumerate(tokens) if token in EOS]
    return tokens[:ends[0] + 1] if ends else tokens


@pytest.fixture
def captured(target, head, monkeypatch):
    """The target and the head graphed on the CPU through the stand-in capture (`stand_in_graphs`)."""
    return stand_in_graphs(monkeypatch, (target, head))


def test_graphed_verify_and_head_passes_give_the_eager_outputs_and_lengths(target, head, captured):
    """Passes over rows 0..4 of 8 (bucket 8: rows 5..7 spare): the target's verify with features, the head's pass
    over them and a drafting pass give what the eager passes give, and spare rows keep their lengths."""
    layers, prompts = head.head_config.feature_layers, _prompts(8, seed=2)
    graphed_target, graphed_head = GraphedModel(target), GraphedHead(head)
    caches = [(target.new_cache(8, 64), head.new_cache(8, 64)) for _ in range(2)]  # eager, graphed
    packed = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        for target_cache, head_cache in caches:
            target(packed, target_cache, last=0, new_tokens=[len(p) for p in prompts])
            head(packed, torch.zeros(len(packed), head.head_config.feature_size), head_cache, last=0,
                 new_tokens=[len(p) for p in prompts])
        tokens = torch.randint(0, 64, (5, 3), generator=torch.Generator().manual_seed(0))
        runs = []
        for (target_cache, head_cache), (verify, draft) in zip(caches, ((target, head),
                                                                        (graphed_target, graphed_head))):
            logits, features = verify(tokens, target_cache.rows(0, 5), features=layers)
            _, settled = draft(tokens, features, head_cache.rows(0, 5), last=0)
            drafted = draft(tokens[:, :1], settled[:, -1:], head_cache.rows(0, 5), last=1, from_target=False)
            runs.append([logits, features, settled, *drafted])
    for eager, ours in zip(*runs):
        torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    for eager, ours in zip(caches[0], caches[1]):  # the target's caches, then the head's
        assert ours.host_lengths.tolist() == ours.lengths.tolist() == eager.host_lengths.tolist()
        assert ours.host_lengths[5:].tolist() == [len(p) for p in prompts[5:]]  # spare rows: as they were
    # the ladder of every key: the target's verify (logits, features), the head's two kinds of pass
    assert captured == [(torch.Size([b, 3, 64]), torch.Size([b, 3, 3 * 32])) for b in (1, 2, 4, 8)] \
        + [(None, torch.Size([b, 3, 32])) for b in (1, 2, 4, 8)] \
        + [(torch.Size([b, 1, 64]), torch.Size([b, 1, 32])) for b in (1, 2, 4, 8)]
    assert sorted(graphed_head.buffers) == sorted(
        [("inputs", b, 3, True) for b in (1, 2, 4, 8)] + [("outputs", b, n) for b in (1, 2, 4, 8) for n in (1, 3)]
        + [("inputs", b, 1, False) for b in (1, 2, 4, 8)] + [("logits", b, 1, 1) for b in (1, 2, 4, 8)])


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_with_a_graphed_head_equals_target_only_and_the_eager_run(target, head, captured, batch):
    """k changing every step (0..4), ragged prompts; rows leave the batch (EOS), so passes replay smaller
    buckets. A second generation replays what the first captured."""
    prompts = _prompts(batch, seed=batch + 10)
    expected = [until_eos(naive_greedy(target, prompt, 24)) for prompt in prompts]
    eager = SpeculativeGenerator(target, head, eos_token_ids=EOS, cuda_graphs=False).generate(prompts, 24,
                                                                                              TurningK())
    generator = SpeculativeGenerator(target, head, eos_token_ids=EOS, cuda_graphs=True)
    policy = TurningK()
    graphed = generator.generate(prompts, 24, policy)
    assert graphed.token_ids == eager.token_ids == expected
    assert graphed.stats.k_per_step == eager.stats.k_per_step and set(graphed.stats.k_per_step) == set(KS)
    assert graphed.stats.accepted_per_position == eager.stats.accepted_per_position
    assert generator.drafter.runner.stats()["captures"] > 0  # the head's passes ran graphed
    if batch == 8:
        assert min(graphed.stats.batch_size_per_step) == 2  # rows left: buckets 4 and 2 replayed
    stats = generator.graph_stats()
    policy.calls = 0
    assert generator.generate(prompts, 24, policy).token_ids == expected
    assert generator.graph_stats()["captures"] == stats["captures"]  # warmed up: nothing captured


def test_the_memory_plan_counts_the_graph_buffers_a_head_generation_allocates(target, head, captured):
    """calibrate.memory's graphs of a generation with a head (k = 0..4 at b = 8): the pools it
    estimates, and exactly the bytes of the buffers the runtime allocated: the target's logits and features,
    the head's inputs, outputs and drafting logits."""
    from specbatch.calibrate.memory import generation_graph_bytes, pass_bytes
    from specbatch.calibrate.models import model_info
    from specbatch.runtime.loading import ModelSpec

    target_info = model_info(ModelSpec("target", "t", target.config, None), torch.float32)
    head_info = model_info(ModelSpec("draft", "h", head.config, None, head=head.head_config), torch.float32)
    prompts, new_tokens = _prompts(8, seed=1), 24
    generator = SpeculativeGenerator(target, head, cuda_graphs=True)
    generator.generate(prompts, new_tokens, TurningK())
    key_len = max(map(len, prompts)) + new_tokens + 5
    pools = pass_bytes(target_info, 8, 5, key_len, 8 * 5, False) + pass_bytes(head_info, 8, 5, key_len, 8, False)
    buffers = [*generator.target_runner.buffers.values(), *generator.drafter.runner.buffers.values()]
    assert {key[0] for key in generator.target_runner.buffers} == {"logits", "features"}
    assert generation_graph_bytes(target_info, head_info, 8, range(5), key_len, False) \
        == pools + sum(buffer.nbytes for buffer in buffers)


def test_calibration_times_a_heads_passes_graphed(target, head, captured, monkeypatch):
    """With graphs, ForwardTimer times a head's passes as the runtime runs them: drafting (1 token) and the pass
    over the verified positions (3), each replaying the graph of b's bucket, captured before the point's first
    sample and never inside one; without, the head runs eagerly."""
    from specbatch.calibrate import benchmarks
    from specbatch.calibrate.benchmarks import ForwardTimer
    from specbatch.calibrate.grid import TimingPoint, make_grid
    from specbatch.calibrate.timing import RepetitionRule

    captures_at_first_sample = []
    real_repeat = benchmarks.repeat

    def watched_repeat(sampler, rule, clock):
        captures_at_first_sample.append(len(captured))
        return real_repeat(sampler, rule, clock)

    monkeypatch.setattr(benchmarks, "repeat", watched_repeat)
    grid, rule = make_grid((5,), (16,), 2, head=True), RepetitionRule(warmup_reps=0, min_reps=2, budget_s=0.0)
    timer = ForwardTimer({"target": target, "draft": head}, grid, "cpu", rule, graphs=True)
    for n in (1, 3):
        assert timer.measure(TimingPoint("draft", 5, n, 16)).reps >= 2
    assert isinstance(timer.runners["draft"], GraphedHead) and timer.cache.root.batch_size == 8
    assert captured == [(torch.Size([b, 1, 64]), torch.Size([b, 1, 32])) for b in (1, 2, 4, 8)] \
        + [(None, torch.Size([b, 3, 32])) for b in (1, 2, 4, 8)]
    assert captures_at_first_sample == [4, 8]
    assert ForwardTimer({"draft": head}, grid, "cpu", rule).models["draft"].head is head  # eager


@pytest.mark.gpu
def test_a_graphed_head_matches_eager_on_a_gpu(target, head):
    graphed_equals_eager_on_a_gpu(target, head)


def graphed_equals_eager_on_a_gpu(target, head) -> None:
    """On CUDA in bfloat16, the graphed generation's tokens and acceptance equal the eager one's (k changing every
    step); the models are moved back to the CPU in float32 after."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    moved(target, "cuda", torch.bfloat16)
    moved(head, "cuda", torch.bfloat16)
    try:
        prompts = _prompts(8, seed=3)
        got = {graphs: SpeculativeGenerator(target, head, cuda_graphs=graphs).generate(prompts, 24, TurningK())
               for graphs in (False, True)}
        assert got[True].token_ids == got[False].token_ids
        assert got[True].stats.accepted_per_position == got[False].stats.accepted_per_position
    finally:
        moved(target, "cpu", torch.float32), moved(head, "cpu", torch.float32)


def test_a_server_with_a_head_captures_every_graph_before_its_first_request(target, head, captured):
    from test_runtime_cuda_graphs import served_after_capturing_ahead

    served_after_capturing_ahead(SpeculativeGenerator(target, head, cuda_graphs=True), _prompts(5, 3), captured)
