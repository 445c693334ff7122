"""Tree steps: tree attention, losslessness, the second stage, compaction, exact sampling, bad input.

Oracles: plain sequential forward passes over each root-to-node path (tree attention); target-only
greedy output (losslessness); the draft's own level-by-level tree (the second stage must not change a
single draft token); a fresh prefill of the committed tokens (compaction); the exact distribution of
the first three tokens on a 6-token vocabulary (sampling). Checked by hand: the sampling cases fail
when the recursive rejection sampling skips the residual update of p, or keeps a rejected child in q.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.perfmodel.tree import Strategy, parse_tree
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.generator import GenerationError, SpeculativeGenerator
from specbatch.runtime.model import TreeAttention
from specbatch.runtime.policy import FixedK, FixedStrategy
from specbatch.runtime.sampling import Sampling, probabilities
from specbatch.runtime.drafters.draft_model import draft_tree
from specbatch.runtime.tree_decoding import plan_for
from torch_fixtures import tune_cpu

TREES = ["0,1", "0,1,2,0.0,0.1,1.0,0.0.0", "0,0.0,0.1,0.0.0,0.0.0.0,0.0.0.1", "chain:4"]
BATCHES = {1: [4], 3: [0, 1, 2], 8: list(range(8))}
N_NEW = 16


class PerfectGuess:
    """A second stage that always guesses the draft's own children: the draft here has no layers, so
    its next token depends on the last token only, which the guesser sees."""

    def __init__(self, draft):
        self.draft, self.vocab_size = draft, draft.config.vocab_size

    def top_tokens_host(self, u, v):
        return tuple(self.draft(torch.tensor([[v]]))[0, -1].topk(4).indices.tolist())

    def top_tokens(self, contexts, count):  # the device query: (n, 2) contexts -> (n, count)
        return torch.stack([torch.tensor(self.top_tokens_host(int(u), int(v))[:count]) for u, v in contexts.tolist()])


class RandomGuess:
    """A second stage that is nearly always wrong."""

    def __init__(self, vocab_size, seed=0):
        self.vocab_size, self.gen = vocab_size, torch.Generator().manual_seed(seed)

    def top_tokens_host(self, u, v):
        return tuple(torch.randperm(self.vocab_size, generator=self.gen)[:4].tolist())

    def top_tokens(self, contexts, count):
        return torch.stack([torch.randperm(self.vocab_size, generator=self.gen)[:count] for _ in range(len(contexts))])


@pytest.fixture(scope="module")
def bigram_draft(greedy_target, llama_config_factory, peaked):
    return peaked(build_model(llama_config_factory(num_layers=0), seed=5))


@pytest.fixture(scope="module")
def reference(greedy_target, prompts8):
    return {size: SpeculativeGenerator(greedy_target, None).generate([prompts8[i] for i in index], N_NEW,
                                                                      FixedK(0)).token_ids
            for size, index in BATCHES.items()}


@pytest.fixture(params=["host", "tensor"])
def bookkeeping(request, monkeypatch):
    """Greedy steps keep their bookkeeping on the host at small sizes and in tensors above: run both."""
    if request.param == "tensor":
        tune_cpu(monkeypatch, host_bookkeeping_max_cells=0)
    return request.param


def _policy(spec: str, stage2: bool = False) -> FixedStrategy:
    return FixedStrategy(Strategy(parse_tree(spec), stage2))


# ---------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 3}], ids=["llama", "sliding-window"])
@pytest.mark.parametrize("long_prefix", [5, 60], ids=["near", "far-apart"])
@torch.no_grad()
def test_tree_attention_equals_each_path_fed_alone(llama_config_factory, overrides, long_prefix, backend):
    """Rows of different cache lengths (far apart: they attend in separate runs on the sdpa backend)."""
    model = build_model(llama_config_factory(**overrides), seed=3)
    model.attention_backend = backend
    tree = parse_tree("0,1,2,0.0,0.1,1.0,0.0.0")
    plan = plan_for(tree, torch.device("cpu"))
    long = torch.randint(0, 64, (long_prefix,), generator=torch.Generator().manual_seed(1)).tolist()
    prefixes = [long, [3, 8]]  # ragged rows: different cache lengths
    nodes = torch.randint(0, 64, (2, tree.num_nodes + 1), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(2, 80)
    model(torch.tensor(long[:-1] + [3]), cache, last=0, new_tokens=[len(long) - 1, 1])
    nodes[:, 0] = torch.tensor([p[-1] for p in prefixes])
    logits = model(nodes, cache, TreeAttention(plan.depths, plan.target_mask))
    for row, prefix in enumerate(prefixes):
        for node in range(tree.num_nodes + 1):
            path = np.flatnonzero(plan.target_mask[node].numpy())  # root..node
            sequence = torch.tensor([prefix[:-1] + nodes[row, path].tolist()])
            expected = model(sequence)[0, -1]
            torch.testing.assert_close(logits[row, node], expected, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("spec", TREES)
@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("kind", ["always", "sometimes", "never"])
def test_tree_greedy_equals_target_only(kind, size, spec, greedy_target, greedy_draft_sometimes,
                                        greedy_draft_never, prompts8, reference, bookkeeping):
    draft = {"always": greedy_target, "sometimes": greedy_draft_sometimes, "never": greedy_draft_never}[kind]
    prompts = [prompts8[i] for i in BATCHES[size]]
    tree = parse_tree(spec)
    recorder = StepRecorder("cpu")
    result = SpeculativeGenerator(greedy_target, draft).generate(prompts, N_NEW, _policy(spec), observer=recorder)
    assert result.token_ids == reference[size]
    stats = result.stats
    if kind == "always":  # the whole deepest path is accepted at every full step
        assert stats.accepted_per_position[-1] > 0 and stats.acceptance_per_position[0] == 1.0
    if kind == "never" and tree.max_children == 1:  # its top token is never the target's (lower ranks may be)
        assert sum(stats.accepted_per_position) == 0 and stats.steps == N_NEW - 1
    assert recorder.pass_shapes("target")[-1][1] == tree.num_nodes + 1
    assert recorder.per_step("nodes")[-1] == tree.num_nodes and recorder.per_step("k")[-1] == tree.depth


@pytest.mark.parametrize("spec", TREES)
@pytest.mark.parametrize("size", [1, 3, 8])
def test_staged_tree_greedy_equals_target_only(size, spec, greedy_target, bigram_draft, prompts8, reference,
                                               bookkeeping):
    prompts = [prompts8[i] for i in BATCHES[size]]
    for guess in (PerfectGuess(bigram_draft), RandomGuess(64, seed=size)):
        generator = SpeculativeGenerator(greedy_target, bigram_draft, stage2=guess)
        assert generator.generate(prompts, N_NEW, _policy(spec, stage2=True)).token_ids == reference[size]


@pytest.mark.parametrize("spec", TREES)
@torch.no_grad()
def test_second_stage_changes_the_cost_not_the_draft(spec, bigram_draft, greedy_draft_sometimes, prompts8,
                                                     bookkeeping):
    """Draft-tree tokens with any guesser equal the draft's own level-by-level tree; a perfect guesser
    needs one draft pass per tree, a hopeless one as many as there are levels."""
    tree = parse_tree(spec)
    plan = plan_for(tree, torch.device("cpu"))
    prompts = [prompts8[i] for i in BATCHES[8]]
    width = max(map(len, prompts))
    tokens = torch.tensor([p + [0] * (width - len(p) + 40) for p in prompts])
    committed = torch.tensor([len(p) for p in prompts])
    inner_levels = len({tree.depths[n] for n in tree.inner_nodes})
    for draft in (bigram_draft, greedy_draft_sometimes):
        drafted = {}
        for name, guess in (("plain", None), ("perfect", PerfectGuess(bigram_draft)), ("random", RandomGuess(64))):
            cache = draft.new_cache(8, tokens.shape[1])
            draft(tokens[:, :width], cache)
            cache.lengths = committed - 3  # rows lag: the catch-up pass re-feeds three tokens
            drafted[name] = draft_tree(plan, draft, cache, tokens, committed, committed.numpy(), Sampling(), None,
                                       stage2=guess, host_bookkeeping=True)
            assert int(cache.lengths[0]) == int(committed[0]) + len(plan.inner)
        assert torch.equal(drafted["plain"].tokens, drafted["perfect"].tokens)
        assert torch.equal(drafted["plain"].tokens, drafted["random"].tokens)
        assert drafted["plain"].rounds == inner_levels
        if draft is bigram_draft:
            assert drafted["perfect"].rounds == 1
        assert drafted["random"].rounds >= 1


@torch.no_grad()
def test_compaction_leaves_the_caches_as_a_fresh_prefill(greedy_target, greedy_draft_sometimes, prompts8):
    """After tree steps, every row's target cache up to its length equals a prefill of its tokens."""
    captured = {}

    class Spy(SpeculativeGenerator):
        def _tree_step(self, state, *args):
            out = super()._tree_step(state, *args)
            captured["caches"] = (state.target_cache, state.draft_cache)
            return out

    prompts = [prompts8[i] for i in BATCHES[3]]
    result = Spy(greedy_target, greedy_draft_sometimes).generate(prompts, 7, _policy("0,1,2,0.0,0.1,1.0,0.0.0"))
    target_cache, draft_cache = captured["caches"]
    # the last step's compaction ran before the generator set lengths = committed - 1; check kept slots. Rows
    # that finished earlier left their slots to others (the last running row moves in), so each slot must hold
    # the fresh prefill of one running row, each row in one slot.
    def matches(slot: int, row: int) -> bool:
        sequence = prompts[row] + result.token_ids[row]
        for model, cache in ((greedy_target, target_cache), (greedy_draft_sometimes, draft_cache)):
            kept = int(cache.lengths[slot])
            fresh = model.new_cache(1, 64)
            model(torch.tensor([sequence[:kept]]), fresh)
            if not (torch.allclose(cache.keys[:, slot, :kept], fresh.keys[:, 0, :kept], atol=1e-5, rtol=1e-5)
                    and torch.allclose(cache.values[:, slot, :kept], fresh.values[:, 0, :kept], atol=1e-5,
                                       rtol=1e-5)):
                return False
        return True

    holders = [[row for row in range(len(prompts)) if matches(slot, row)] for slot in range(target_cache.batch_size)]
    assert all(len(rows) == 1 for rows in holders), holders
    assert len({rows[0] for rows in holders}) == target_cache.batch_size


# ---------------------------------------------------------------------------------------------- sampling
V = 6
ROWS = 4000
ALPHA = 1e-3
PROMPT = [1, 4, 2, 5]
SAMPLING_CASES = [  # (tree, stage2, sampling)
    ("0,1,0.0", False, Sampling(temperature=1.0)),
    ("0,1,2,0.0,1.0", False, Sampling(temperature=0.8, top_k=2)),  # the third child is often impossible
    ("0,1,0.0,0.1,0.0.0", True, Sampling(temperature=1.2, top_p=0.9)),
]


@pytest.fixture(scope="module")
def sampling_pair(llama_config_factory, peaked, make_noisy_copy):
    config = llama_config_factory(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32)
    target = peaked(build_model(config, seed=21), 15.0)
    return target, make_noisy_copy(target, num_layers=1, noise=0.8, seed=22)


@pytest.mark.parametrize("spec,staged,sampling", SAMPLING_CASES,
                         ids=[f"{s}{'+ngram' if g else ''}-{m.describe()}" for s, g, m in SAMPLING_CASES])
@torch.no_grad()
def test_tree_sampling_matches_exact_target_distribution(sampling_pair, spec, staged, sampling):
    from scipy import stats as scipy_stats

    target, draft = sampling_pair
    seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    probs = probabilities(target(seqs), sampling).double()
    n = len(PROMPT)
    p1, p2, p3 = probs[0, n - 1], probs[::V, n], probs[:, n + 1].reshape(V, V, V)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).numpy().ravel()
    generator = SpeculativeGenerator(target, draft, stage2=RandomGuess(V) if staged else None)
    result = generator.generate([PROMPT] * ROWS, 3, _policy(spec, staged), sampling, seed=77)
    assert 0 < sum(result.stats.accepted_per_position) < result.stats.trials_per_position[0] * 2
    arr = np.array([t[:3] for t in result.token_ids])
    counts = np.zeros((V, V, V))
    np.add.at(counts, (arr[:, 0], arr[:, 1], arr[:, 2]), 1)
    counts = counts.ravel()
    assert counts[joint <= 0].sum() == 0, "a token of probability 0 was generated"
    keep = joint > 5.0 / ROWS  # cells expected at least 5 times; the rest (if any mass) pooled into one
    observed, expected = counts[keep], joint[keep] * ROWS
    if joint[~keep].sum() > 0:
        observed, expected = np.append(observed, counts[~keep].sum()), np.append(expected, joint[~keep].sum() * ROWS)
    assert scipy_stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > ALPHA


# ---------------------------------------------------------------------------------------------- bad input
def test_tree_larger_than_the_context_is_refused(greedy_target, greedy_draft_sometimes, prompts8):
    tree = ",".join(str(r) for r in range(60))  # 60 children of the root
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    with pytest.raises(GenerationError, match="draft tokens per step.*tree"):
        generator.generate([prompts8[4]], 60, _policy(tree))


def test_staged_strategy_without_a_second_stage_is_refused(greedy_target, greedy_draft_sometimes, prompts8):
    with pytest.raises(GenerationError, match="--stage2"):
        SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate([prompts8[0]], 4, _policy("0,1", True))


def test_second_stage_for_another_vocabulary_is_refused(greedy_target, greedy_draft_sometimes):
    with pytest.raises(GenerationError, match="vocabulary"):
        SpeculativeGenerator(greedy_target, greedy_draft_sometimes, stage2=RandomGuess(65))
