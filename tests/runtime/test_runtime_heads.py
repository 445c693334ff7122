"""Drafting with a head (EAGLE-3, MTP): lossless, exact, and refused in one line when it does not fit its target.

Oracles: target-only greedy output (greedy chains at b = 1, 8, 32 with ragged prompts, k = 1..8); each step's
draft tokens against the head recomputed from scratch on the committed tokens (a fresh cache, no rollback), so
the incremental cache, its roll-back and the hidden state carried between steps are checked, not only the
output; the exact distribution of the first tokens for sampling with a draft vocabulary that is a subset.
"""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.drafters.head import HeadDrafter
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.heads import HeadError, random_head
from specbatch.runtime.heads.config import head_config_from_dict
from specbatch.runtime.model import NORMED_OUTPUT
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling

from lossless_helpers import naive_greedy

NOISE = 0.2  # the MTP head's token norm, perturbed: right about half the time


def head_config(target, kind="eagle3", draft_vocab=None, **extra):
    layer = {"model_type": target.config.model_type, "vocab_size": target.config.vocab_size,
             "hidden_size": target.config.hidden_size, "intermediate_size": 48, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256}
    raw = {"speculators_model_type": kind, "transformer_layer_config": layer, **extra}
    if draft_vocab is not None:
        raw["draft_vocab_size"] = draft_vocab
    return head_config_from_dict(raw, target.config, "head/config.json")


@pytest.fixture(scope="module")
def target(llama_config_factory, peaked):
    return peaked(build_model(llama_config_factory(max_position_embeddings=256), seed=31))


@pytest.fixture(scope="module")
def eagle_head(target):
    """An EAGLE-3 head with a 48-token draft vocabulary (every 4/3rd target id): random, so it agrees with the
    target now and then."""
    head = random_head(head_config(target, draft_vocab=48, eagle_aux_hidden_state_layer_ids=[0, 1, 2]), target,
                       seed=5)
    with torch.no_grad():
        head.lm_head.weight.mul_(6.0)
    return head


@pytest.fixture(scope="module")
def echo_target(llama_config_factory, peaked):
    """A target whose next token is a function of the current one (attention and MLP outputs zeroed): an MTP head
    can learn it exactly, so drafts are accepted often and every branch of the bookkeeping runs."""
    model = peaked(build_model(llama_config_factory(max_position_embeddings=256, num_layers=1), seed=41))
    with torch.no_grad():
        model.layers[0].o.weight.zero_()
        model.layers[0].down.weight.zero_()
    return model


@pytest.fixture(scope="module")
def mtp_head(echo_target):
    """An MTP head that computes its target's next token from the token embedding (its projection keeps the
    embedding half, its layer adds nothing), with the token norm perturbed so that it is right most of the time."""
    head = random_head(head_config(echo_target, kind="mtp"), echo_target, seed=6)
    d = echo_target.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        head.input_proj.weight.zero_()
        head.input_proj.weight[:, :d].copy_(torch.eye(d))
        head.layers[0].o.weight.zero_()
        head.layers[0].down.weight.zero_()
        head.token_norm.weight.copy_(1.0 + NOISE * torch.randn(d, generator=gen))
        head.final_norm.weight.copy_(echo_target.final_norm.weight)
    return head


def _prompts(count: int, seed: int, vocab: int = 64) -> list[list[int]]:
    gen = np.random.default_rng(seed)
    return [gen.integers(0, vocab, size=int(gen.integers(2, 24))).tolist() for _ in range(count)]


@pytest.mark.parametrize("batch,ks", [(1, (1, 3, 8)), (8, (1, 2, 4, 5)), (32, (6, 7))])
def test_greedy_with_an_eagle3_head_equals_target_only_greedy(target, eagle_head, batch, ks):
    prompts = _prompts(batch, seed=batch)
    expected = [naive_greedy(target, p, 20) for p in prompts]
    generator = SpeculativeGenerator(target, eagle_head)
    for k in ks:
        result = generator.generate(prompts, 20, FixedK(k))
        assert result.token_ids == expected, k
        assert set(result.stats.k_per_step) == {k}


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_with_an_mtp_head_accepts_often_and_stays_lossless(echo_target, mtp_head, k):
    prompts = _prompts(8, seed=3)
    expected = [naive_greedy(echo_target, p, 24) for p in prompts]
    result = SpeculativeGenerator(echo_target, mtp_head).generate(prompts, 24, FixedK(k))
    assert result.token_ids == expected
    rates = result.stats.acceptance_per_position
    assert 0.3 < rates[0] < 1.0  # right often, wrong sometimes: accepting and rejecting both run


def _fresh_drafts(target, head, committed: list[int], k: int) -> list[int]:
    """The head's k greedy draft tokens after `committed`, recomputed from scratch: one target pass over the
    committed tokens, one head pass over positions 1.. on a new cache, then k - 1 passes of one token."""
    features = head.head_config.feature_layers
    tokens = torch.tensor([committed])
    _, taken = target(tokens[:, :-1], None, features=features)  # hidden states at positions 0..c-2
    cache = head.new_cache(1, len(committed) + k + 1)
    logits, outputs = head(tokens[:, 1:], taken, cache, last=1)
    drafts, hidden = [], outputs[:, -1:]
    for i in range(k):
        drafts.append(int(logits[0, -1].argmax()))
        if i + 1 < k:
            logits, hidden = head(torch.tensor([[drafts[-1]]]), hidden, cache, last=1, from_target=False)
    return drafts


@pytest.mark.parametrize("fixture", ["eagle", "mtp"])
def test_each_steps_drafts_equal_the_head_recomputed_from_scratch(request, fixture):
    model, head = ((request.getfixturevalue("target"), request.getfixturevalue("eagle_head")) if fixture == "eagle"
                   else (request.getfixturevalue("echo_target"), request.getfixturevalue("mtp_head")))
    seen: list[tuple[list[list[int]], list[list[int]]]] = []
    original = HeadDrafter.chain

    def recording(self, state, k, passes):
        tokens, probs = original(self, state, k, passes)
        committed = [state.tokens[r, :int(state.host_committed[r])].tolist() for r in range(state.batch_size)]
        seen.append((committed, tokens.tolist()))
        return tokens, probs

    HeadDrafter.chain = recording
    try:
        SpeculativeGenerator(model, head).generate(_prompts(4, seed=9), 16, FixedK(3))
    finally:
        HeadDrafter.chain = original
    assert len(seen) >= 5
    with torch.no_grad():
        for committed, drafted in seen:
            for row, tokens in zip(committed, drafted):
                assert tokens == _fresh_drafts(model, head, row, 3)


def test_a_k0_step_keeps_the_head_current(target, eagle_head):
    """Steps at k = 0 between drafting steps (a table's choice at some batch size) still feed the head."""
    class Alternating:
        max_k, calls = 4, 0

        def __call__(self, batch_size, context_len=None):
            self.calls += 1
            return 0 if self.calls % 3 == 0 else 4

        def describe(self):
            return "k=4, 0 every third step"

    prompts = _prompts(6, seed=4)
    result = SpeculativeGenerator(target, eagle_head).generate(prompts, 18, Alternating())
    assert result.token_ids == [naive_greedy(target, p, 18) for p in prompts]
    assert 0 in result.stats.k_per_step and 4 in result.stats.k_per_step


def _small_target_and_subset_head(llama_config_factory, peaked):
    """The sampling tests' small target (test_runtime_sampling's vocabulary) and an EAGLE-3 head whose draft
    vocabulary holds 4 of its 6 ids."""
    from test_runtime_sampling import V

    config = llama_config_factory(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32)
    small_target = peaked(build_model(config, seed=21), 15.0)
    layer = {"model_type": "llama", "vocab_size": V, "hidden_size": 16, "intermediate_size": 32,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64}
    head = random_head(head_config_from_dict({"speculators_model_type": "eagle3", "transformer_layer_config": layer,
                                              "draft_vocab_size": 4}, config, "head"), small_target, seed=8)
    return small_target, head


def test_sampling_with_a_subset_draft_vocabulary_is_exactly_the_targets(llama_config_factory, peaked):
    from test_runtime_sampling import ALPHA, PROMPT, ROWS, V, _chi2_pvalue, _counts, _exact

    small_target, head = _small_target_and_subset_head(llama_config_factory, peaked)
    sampling = Sampling(temperature=1.0)
    p1, p2, p3 = _exact(small_target, sampling)
    result = SpeculativeGenerator(small_target, head).generate([PROMPT] * ROWS, 3, FixedK(2), sampling, seed=99)
    rates = result.stats.acceptance_per_position
    assert 0.05 < rates[0] < 0.95  # the head's proposals are accepted and rejected
    counts3 = _counts(result.token_ids, 3)
    assert _chi2_pvalue(counts3, (p1[:, None, None] * p2[:, :, None] * p3).numpy()) > ALPHA
    # the draft vocabulary misses two target ids: the head never proposes them, the target still produces them
    missing = sorted(set(range(V)) - set(head.draft_to_target.tolist()))
    assert len(missing) == 2 and counts3.sum((1, 2))[missing].sum() > 0


TREES = ("0,1,0.0", "0,1,2,0.0,0.1,1.0,0.0.0", "0,0.0,0.0.0,0.0.1")


def _tree_policy(spec: str):
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.policy import FixedStrategy

    return FixedStrategy(Strategy(parse_tree(spec)))


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_greedy_trees_with_an_eagle3_head_equal_target_only_greedy(target, eagle_head, batch):
    prompts = _prompts(batch, seed=batch + 100)
    expected = [naive_greedy(target, p, 16) for p in prompts]
    generator = SpeculativeGenerator(target, eagle_head)
    for spec in TREES:
        assert generator.generate(prompts, 16, _tree_policy(spec)).token_ids == expected, spec


@pytest.mark.parametrize("spec", TREES)
def test_greedy_trees_with_an_mtp_head_accept_deep_paths_and_stay_lossless(echo_target, mtp_head, spec):
    prompts = _prompts(8, seed=13)
    result = SpeculativeGenerator(echo_target, mtp_head).generate(prompts, 24, _tree_policy(spec))
    assert result.token_ids == [naive_greedy(echo_target, p, 24) for p in prompts]
    assert max(result.stats.acceptance_per_position[1:] or [0]) > 0  # paths past the first level are accepted


def _fresh_tree(target, head, committed: list[int], tree) -> list[int]:
    """Every node's token of a greedy tree drafted by `head` after `committed`, recomputed from scratch: a node's
    children are the top-ranked tokens of the head's logits after the path to it, each path run on a new cache
    (one target pass, one head pass over the committed positions, then one-token passes along the path)."""
    features = head.head_config.feature_layers
    tokens = torch.tensor([committed])
    _, taken = target(tokens[:, :-1], None, features=features)
    tokens_of = {0: committed[-1]}
    for node in range(tree.num_nodes + 1):
        if not tree.children[node]:
            continue
        path = []  # the node's ancestors below the root, then the node itself
        walk = node
        while walk:
            path.append(walk)
            walk = tree.parents[walk]
        cache = head.new_cache(1, len(committed) + tree.depth + 2)
        logits, outputs = head(tokens[:, 1:], taken, cache, last=1)
        hidden = outputs[:, -1:]
        for ancestor in reversed(path):
            logits, hidden = head(torch.tensor([[tokens_of[ancestor]]]), hidden, cache, last=1, from_target=False)
        top = logits[0, -1].topk(len(tree.children[node])).indices.tolist()
        for rank, child in enumerate(tree.children[node]):
            tokens_of[child] = top[rank]
    return [tokens_of[node] for node in range(tree.num_nodes + 1)]


@pytest.mark.parametrize("fixture", ["eagle", "mtp"])
def test_each_steps_tree_equals_the_head_recomputed_from_scratch(request, fixture):
    """Every node of every drafted tree (children by rank of their parent's logits), so the level passes' inputs
    (each node's parent's output), their tree attention and the settle over the accepted path are all checked."""
    from specbatch.perfmodel.tree import parse_tree

    model, head = ((request.getfixturevalue("target"), request.getfixturevalue("eagle_head")) if fixture == "eagle"
                   else (request.getfixturevalue("echo_target"), request.getfixturevalue("mtp_head")))
    spec = TREES[1]
    seen = []
    original = HeadDrafter.tree

    def recording(self, state, plan, staged, passes):
        drafted = original(self, state, plan, staged, passes)
        committed = [state.tokens[r, :int(state.host_committed[r])].tolist() for r in range(state.batch_size)]
        seen.append((committed, drafted.tokens.tolist()))
        return drafted

    HeadDrafter.tree = recording
    try:
        SpeculativeGenerator(model, head).generate(_prompts(4, seed=19), 16, _tree_policy(spec))
    finally:
        HeadDrafter.tree = original
    assert len(seen) >= 4
    tree = parse_tree(spec)
    with torch.no_grad():
        for committed, drafted in seen:
            for row, tokens in zip(committed, drafted):
                assert tokens == _fresh_tree(model, head, row, tree)


def test_chains_trees_and_k0_steps_mixed_with_a_head_stay_lossless(target, eagle_head):
    """The head's cache and carried output stay right whichever kind of step ran before."""
    from specbatch.perfmodel.tree import Strategy, parse_tree

    choices = [Strategy(parse_tree(TREES[1])), 0, 3, Strategy(parse_tree(TREES[0])), 1]

    class Turning:
        max_k, calls = 7, 0  # the larger tree's nodes

        def __call__(self, batch_size, context_len=None):
            self.calls += 1
            return choices[(self.calls - 1) % len(choices)]

        def describe(self):
            return "trees, chains and k = 0 in turn"

    prompts = _prompts(6, seed=23)
    result = SpeculativeGenerator(target, eagle_head).generate(prompts, 20, Turning())
    assert result.token_ids == [naive_greedy(target, p, 20) for p in prompts]


def test_sampling_a_tree_with_a_subset_draft_vocabulary_is_exactly_the_targets(llama_config_factory, peaked):
    from test_runtime_sampling import ALPHA, PROMPT, ROWS, _chi2_pvalue, _counts, _exact

    small_target, head = _small_target_and_subset_head(llama_config_factory, peaked)
    sampling = Sampling(temperature=1.0)
    p1, p2, p3 = _exact(small_target, sampling)
    result = SpeculativeGenerator(small_target, head).generate([PROMPT] * ROWS, 3, _tree_policy("0,1,0.0"),
                                                                sampling, seed=98)
    counts3 = _counts(result.token_ids, 3)
    assert _chi2_pvalue(counts3, (p1[:, None, None] * p2[:, :, None] * p3).numpy()) > ALPHA


@pytest.mark.parametrize("change,message", [
    (dict(hidden_size=48), "hidden size 48, the target's is 32"),
    (dict(vocab_size=100), "vocabulary of 100 tokens, the target's has 64"),
    (dict(model_type="gpt2"), "the head's layer is a 'gpt2' layer"),
])
def test_a_head_whose_layer_does_not_fit_its_target_is_refused_in_one_line(target, change, message):
    layer = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, **change}
    with pytest.raises(HeadError, match=message) as caught:
        head_config_from_dict({"speculators_model_type": "eagle3", "transformer_layer_config": layer},
                              target.config, "head/config.json")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("extra,message", [
    (dict(eagle_aux_hidden_state_layer_ids=[0, 1, 3]), r"\[3\] are outside the target's layers 0..2"),
    (dict(draft_vocab_size=65), "draft_vocab_size 65 exceeds"),
    (dict(speculators_model_type="dflash"), "'dflash' is not supported"),
    (dict(norm_before_fc=True, fc_norm=True), "exclude each other"),
])
def test_head_config_refusals(target, extra, message):
    with pytest.raises(HeadError, match=message):
        head_config(target, **extra)


def test_a_head_for_a_family_outside_the_head_format_is_refused(target):
    gpt2 = replace(target.config, model_type="gpt2")
    with pytest.raises(HeadError, match="a head drafts for a llama/qwen3 target"):
        head_config_from_dict({"speculators_model_type": "mtp", "transformer_layer_config": {}}, gpt2, "h")


def test_heads_read_the_features_their_format_names(target):
    assert head_config(target).feature_layers == (0, 1, 2)  # a 2-layer target: (0, L // 2, L)
    assert head_config(target, kind="mtp").feature_layers == (NORMED_OUTPUT,)


def test_saved_head_loads_with_its_vocabulary_map_and_refuses_a_missing_one(target, eagle_head, tmp_path):
    from safetensors.torch import save_file

    from specbatch.runtime.heads import load_head

    state = dict(eagle_head.state_dict())
    state.pop("draft_to_target")
    state = _speculators_names(state, eagle_head)
    d2t = eagle_head.draft_to_target - torch.arange(48)
    layer = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256}
    config = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": 48,
              "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({**state, "d2t": d2t.contiguous()}, str(tmp_path / "model.safetensors"))
    loaded = load_head(tmp_path, target)
    tokens, features = torch.tensor([[3, 9, 27]]), torch.randn(1, 3, 96)
    with torch.no_grad():
        cache_a, cache_b = eagle_head.new_cache(1, 8), loaded.new_cache(1, 8)
        torch.testing.assert_close(loaded(tokens, features, cache_b)[0], eagle_head(tokens, features, cache_a)[0])
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadError, match="hold no d2t map"):
        load_head(tmp_path, target)


def _speculators_names(state: dict, head) -> dict:
    """Our head's parameters under the names `speculators` saves (q, k, v and gate, up unfused)."""
    out = {}
    layer = head.layers[0]
    q, kv, inter = layer.q_size, layer.kv_size, head.config.intermediate_size
    for name, tensor in state.items():
        if name == "layers.0.qkv.weight":
            out["layers.0.self_attn.q_proj.weight"] = tensor[:q]
            out["layers.0.self_attn.k_proj.weight"] = tensor[q:q + kv]
            out["layers.0.self_attn.v_proj.weight"] = tensor[q + kv:]
        elif name == "layers.0.gate_up.weight":
            out["layers.0.mlp.gate_proj.weight"], out["layers.0.mlp.up_proj.weight"] = tensor[:inter], tensor[inter:]
        else:
            renamed = {"layers.0.o.weight": "layers.0.self_attn.o_proj.weight",
                       "layers.0.down.weight": "layers.0.mlp.down_proj.weight",
                       "layers.0.attn_norm.weight": "layers.0.input_layernorm.weight",
                       "layers.0.mlp_norm.weight": "layers.0.post_attention_layernorm.weight",
                       "hidden_norm.weight": "layers.0.hidden_norm.weight"}.get(name, name)
            out[renamed] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def test_the_demo_heads_training_forward_is_the_runtimes_drafting():
    """data/train_demo_head.py trains on unrolled drafting steps computed in parallel over a sequence; each step's
    logits equal what the runtime computes when it drafts there (a first pass over the positions up to i, then
    passes of one token on its own outputs)."""
    from specbatch.data.train_demo_head import FEATURE_LAYERS, TTT_STEPS, head_config, ttt_logits
    from specbatch.data.train_demo_pair import TARGET

    config = replace(TARGET, hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64)
    model = build_model(config, seed=0)
    head = random_head(head_config(config, 100), model, seed=1)
    tokens = torch.randint(0, config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, features = model(tokens[:, :-1], None, features=FEATURE_LAYERS)
        unrolled = ttt_logits(head, tokens[:, 1:], features, TTT_STEPS)
        for i in range(10):
            cache = head.new_cache(1, 16)
            _, outputs = head(tokens[:, 1:i + 2], features[:, :i + 1], cache, last=0)
            hidden = outputs[:, -1:]
            torch.testing.assert_close(head.draft_logits(hidden)[0, 0], unrolled[0][0, i])
            for step in range(1, min(TTT_STEPS, 10 - i)):
                _, hidden = head(tokens[:, i + 1 + step:i + 2 + step], hidden, cache, last=1, from_target=False)
                torch.testing.assert_close(head.draft_logits(hidden)[0, 0], unrolled[step][0, i])
