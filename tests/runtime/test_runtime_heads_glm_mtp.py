"""A GLM-4.5 target's own MTP layer as its drafter (`--draft mtp`; runtime.heads.config.target_mtp_config).

Checkpoints: tiny random glm4_moe models built with transformers (8 experts top-2 under grouped sigmoid routing, a
shared expert, half-rotary heads, q/k/v biases, q/k norms), saved as sharded safetensors with
`num_nextn_predict_layers` 1; the MTP layer's tensors (`model.layers.2.*` for 2 decoder layers) are spread over the
shards and a shard of their own, the index naming each. Its decoder layer is transformers' own
`Glm4MoeDecoderLayer` of index 2 (a mixture of experts, or a dense layer where `first_k_dense_replace` says so).

Oracles: one MTP pass computed from that transformers layer and torch ops for enorm, hnorm, eh_proj and
shared_head, uncached over every entry so far (vLLM's glm4_moe_mtp.py order: the embedding zeroed at position 0);
target-only greedy output; the head recomputed from scratch; the exact distribution of the first tokens.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.glm4_moe.modeling_glm4_moe")

from specbatch.perfmodel.errors import UsageError  # noqa: E402
from specbatch.runtime.checkpoint import build_model  # noqa: E402
from specbatch.runtime.config import config_from_dict  # noqa: E402
from specbatch.runtime.drafters.head import HeadDrafter  # noqa: E402
from specbatch.runtime.experts import RoutedExperts  # noqa: E402
from specbatch.runtime.generator import SpeculativeGenerator  # noqa: E402
from specbatch.runtime.heads import HeadError, HeadPasses, random_head  # noqa: E402
from specbatch.runtime.heads.config import TARGET_MTP, target_mtp_config  # noqa: E402
from specbatch.runtime.loading import load_pair, resolve_pair  # noqa: E402
from specbatch.runtime.model import NORMED_OUTPUT  # noqa: E402
from specbatch.runtime.policy import FixedK  # noqa: E402
from specbatch.runtime.sampling import Sampling  # noqa: E402

from lossless_helpers import naive_greedy  # noqa: E402
from test_runtime_families_moe import _randomized  # noqa: E402
from test_runtime_heads import TREES, _fresh_drafts, _fresh_tree, _prompts, _tree_policy  # noqa: E402

TOL = 1e-4
V, D, LAYERS = 96, 32, 2  # the MTP layer is layers.2
SMALL = dict(vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=48, moe_intermediate_size=16, max_position_embeddings=128, n_routed_experts=8,
             num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
             norm_topk_prob=True, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
# routed: the MTP layer a mixture of experts (as GLM-4.5's), its embeddings and LM head its own (GLM-4.5 stores
# copies; these differ from the target's). dense: first_k_dense_replace past it (a dense MTP layer, dense target),
# its embeddings a copy of the target's (shared on loading) and no LM head (GLM-4.6 leaves it out)
VARIANTS = {"routed": 1, "dense": LAYERS + 1}
MAX_DIFF: dict[str, float] = {}  # the largest logit difference each oracle test saw (reported on failure)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _hf_config(first_dense: int, layers: int = LAYERS):
    return transformers.Glm4MoeConfig(**SMALL, num_hidden_layers=layers, first_k_dense_replace=first_dense)


def _shards(directory) -> dict:
    from safetensors.torch import load_file

    return {shard.name: load_file(str(shard)) for shard in sorted(directory.glob("*.safetensors"))}


def _write_with_mtp(directory, mtp: dict) -> None:
    """Add the MTP layer's tensors to a saved sharded checkpoint: every third one in a shard of its own, the
    others appended to the existing shards in turn; the index names each one's shard."""
    from safetensors.torch import save_file

    shards = _shards(directory)
    names = sorted(shards)
    shards["model-mtp.safetensors"] = {}
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for i, (name, tensor) in enumerate(sorted(mtp.items())):
        shard = "model-mtp.safetensors" if i % 3 == 0 else names[i % len(names)]
        shards[shard][name] = tensor.contiguous()
        index["weight_map"][name] = shard
    for shard, tensors in shards.items():
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))


class Checkpoint:
    """A saved glm4_moe target with an MTP layer, the transformers target, and the MTP layer's pieces."""

    def __init__(self, directory, hf, block, tensors: dict, config):
        self.directory, self.hf, self.block, self.tensors, self.config = directory, hf, block, tensors, config

    def oracle(self, tokens: torch.Tensor, hidden: torch.Tensor, mask_first: bool = True):
        """One uncached MTP pass over the entries (tokens (1, n), hidden (1, n, D)) at positions 0..n-1: transformers'
        decoder layer between torch's enorm/hnorm/eh_proj and shared_head. Returns (the layer's output, logits)."""
        t = self.tensors
        n = tokens.shape[1]
        positions = torch.arange(n)[None]
        embeds = F.embedding(tokens, t["embed_tokens.weight"])
        if mask_first:
            embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
        x = F.linear(torch.cat([self._norm(embeds, "enorm"), self._norm(hidden, "hnorm")], dim=-1),
                     t["eh_proj.weight"])
        rotary = modeling.Glm4MoeRotaryEmbedding(self.config)(x, positions)
        mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        return out, F.linear(self._norm(out, "shared_head.norm"), t["shared_head.head.weight"])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        norm = modeling.Glm4MoeRMSNorm(D, eps=self.config.rms_norm_eps)
        norm.weight.copy_(self.tensors[f"{name}.weight"])
        return norm(x)

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        """transformers' target's output after its final norm: what vLLM feeds its MTP layer."""
        return self.hf.model(input_ids=ids).last_hidden_state


def _build(directory, variant: str, randomize, seed: int) -> Checkpoint:
    from safetensors.torch import load_file

    first_dense = VARIANTS[variant]
    torch.manual_seed(seed)
    hf = _randomized(transformers.Glm4MoeForCausalLM(_hf_config(first_dense)), randomize, seed)
    # the MTP layer's decoder layer: layer 2 of a 3-layer model of the same config, and its tensors as saved
    bigger = _randomized(transformers.Glm4MoeForCausalLM(_hf_config(first_dense, LAYERS + 1)), randomize, seed + 1)
    scratch = directory.parent / f"{directory.name}-bigger"
    bigger.save_pretrained(str(scratch))
    prefix = f"model.layers.{LAYERS}."
    mtp = {name: tensor for name, tensor in load_file(str(scratch / "model.safetensors")).items()
           if name.startswith(prefix)}
    shutil.rmtree(scratch)
    gen = torch.Generator().manual_seed(seed + 2)
    own = {"enorm.weight": 1 + 0.2 * torch.randn(D, generator=gen),
           "hnorm.weight": 1 + 0.2 * torch.randn(D, generator=gen),
           "eh_proj.weight": 0.25 * torch.randn(D, 2 * D, generator=gen),
           "shared_head.norm.weight": 1 + 0.2 * torch.randn(D, generator=gen)}
    tensors = dict(own)
    if variant == "routed":
        own["embed_tokens.weight"] = torch.randn(V, D, generator=gen)
        own["shared_head.head.weight"] = 0.25 * torch.randn(V, D, generator=gen)
        tensors.update(own)
    else:
        own["embed_tokens.weight"] = hf.model.embed_tokens.weight.clone()
        tensors.update(own, **{"shared_head.head.weight": hf.lm_head.weight})
    mtp.update({prefix + name: tensor for name, tensor in own.items()})
    hf.save_pretrained(str(directory), max_shard_size="20KB")
    _write_with_mtp(directory, mtp)
    return Checkpoint(directory, hf, bigger.model.layers[LAYERS], tensors, bigger.config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, randomize) -> dict[str, Checkpoint]:
    return {variant: _build(tmp_path_factory.mktemp(variant), variant, randomize, seed=700 + 10 * i)
            for i, variant in enumerate(VARIANTS)}


def _pair(directory):
    """The target and its MTP layer as `--target DIR --draft mtp` loads them."""
    target_spec, draft_spec = resolve_pair(str(directory), "mtp")
    return load_pair(target_spec, draft_spec, "cpu", torch.float32)


@pytest.fixture(scope="module")
def pairs(checkpoints) -> dict:
    return {variant: _pair(checkpoint.directory) for variant, checkpoint in checkpoints.items()}


def _close(name: str, ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    diff = float((ours.float() - expected.float()).abs().max())
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), diff)
    assert diff <= TOL, f"{name}: max abs difference {diff:.3g} > {TOL:g}"


def test_the_mtp_layer_loads_as_a_head_of_the_targets_shapes(checkpoints, pairs):
    routed, dense = pairs["routed"], pairs["dense"]
    head = routed.draft
    assert head.head_config.layout == TARGET_MTP and head.kind == "mtp" and routed.draft_spec.drafter == "mtp"
    assert head.head_config.feature_layers == (NORMED_OUTPUT,)
    assert routed.draft_spec.source == routed.target_spec.source  # the checkpoint vLLM's method "mtp" loads
    assert routed.draft_spec.fingerprint not in (None, routed.target_spec.fingerprint)
    layer = head.layers[0]
    assert layer.experts is not None and layer.experts.shared_gate_up is not None and layer.qkv.bias is not None
    assert head.config.rotary_dim == 8 and head.config.qk_norm and head.config.num_layers == 1
    assert dense.draft.layers[0].experts is None  # first_k_dense_replace past it: a dense MTP layer
    # the routed checkpoint's embeddings and LM head are its own; the dense one's a copy of the target's (shared)
    # and missing (the target's)
    assert head.own_embed is not None and head.shared_head is not None
    assert dense.draft.own_embed is None and dense.draft.shared_head is None
    weight_map = json.loads((checkpoints["routed"].directory / "model.safetensors.index.json").read_text())
    shards = {shard for name, shard in weight_map["weight_map"].items() if name.startswith(f"model.layers.{LAYERS}.")}
    assert len(shards) >= 3 and "model-mtp.safetensors" in shards  # the layer spread over shards
    # the target's loader skips the MTP layer's tensors: its logits are transformers'
    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(0))
    _close("target logits", routed.target(ids), checkpoints["routed"].hf(input_ids=ids).logits)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped-gemm"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_passes_equal_transformers_decoder_layer(checkpoints, pairs, variant, grouped, monkeypatch):
    """A first pass over 9 entries (the target's normed output before each token), then three passes of one token
    on the head's own previous output, on its KV cache; rows of 9 and 5 entries packed (a prefill's ragged pass),
    then a one-token pass on each. Every position's logits (and the layer's output fed on) equal the oracle's."""
    checkpoint, head = checkpoints[variant], pairs[variant].draft
    if head.layers[0].experts is not None:
        monkeypatch.setattr(head.layers[0].experts, "grouped_products", grouped)
    ids = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(1))
    features = checkpoint.features(ids)
    _, ours = pairs[variant].target(ids, None, features=(NORMED_OUTPUT,))
    _close("target features", ours, features)
    # uniform: a pass of 9 entries, then three of one token
    cache = head.new_cache(2, 16)
    logits, outputs = head(ids[:, 1:10], features[:, :9], cache)
    tokens, hidden = ids[:, 1:10], features[:, :9]
    for step in range(4):
        for row in range(2):
            expected_out, expected = checkpoint.oracle(tokens[row:row + 1], hidden[row:row + 1])
            _close("logits", logits[row], expected[0, -logits.shape[1]:])
            _close("outputs", outputs[row], expected_out[0, -outputs.shape[1]:])
        fed = ids[:, 10 + step:11 + step]
        hidden = torch.cat([hidden, outputs[:, -1:]], dim=1)
        tokens = torch.cat([tokens, fed], dim=1)
        logits, outputs = head(fed, outputs[:, -1:], cache, last=1, from_target=False)
    # ragged: rows of 9 and 5 entries packed, then one token each at their own positions
    counts = [9, 5]
    cache = head.new_cache(2, 16)
    packed = torch.cat([ids[0, 1:10], ids[1, 1:6]])
    _, outputs = head(packed, torch.cat([features[0, :9], features[1, :5]]), cache, last=0, new_tokens=counts)
    ends = np.cumsum(counts) - 1
    fed = torch.stack([ids[0, 10:11], ids[1, 6:7]])
    logits, after = head(fed, outputs[ends][:, None], cache, last=1, from_target=False)
    for row, (n, end) in enumerate(zip(counts, ends)):
        row_tokens, row_hidden = ids[row:row + 1, 1:n + 1], features[row:row + 1, :n]
        expected_out, expected = checkpoint.oracle(row_tokens, row_hidden)
        _close("outputs", outputs[end - n + 1:end + 1], expected_out[0])
        _close("logits", head.logits(outputs[end - n + 1:end + 1]), expected[0])
        _, expected = checkpoint.oracle(torch.cat([row_tokens, fed[row:row + 1]], dim=1),
                                        torch.cat([row_hidden, outputs[end][None, None]], dim=1))
        _close("logits", logits[row], expected[0, -1:])


def test_the_oracle_tells_the_mtp_layers_details_apart(checkpoints):
    """Zeroing the embedding at position 0, and feeding the layer's output before its norm to the next pass, each
    change what the oracle computes by far more than the tolerance: the parity above would catch either's omission."""
    checkpoint = checkpoints["routed"]
    ids = torch.randint(3, V, (1, 8), generator=torch.Generator().manual_seed(2))
    features = checkpoint.features(ids)
    out, logits = checkpoint.oracle(ids[:, 1:], features[:, :7])
    _, unmasked = checkpoint.oracle(ids[:, 1:], features[:, :7], mask_first=False)
    assert float((unmasked[0, 0] - logits[0, 0]).abs().max()) > 100 * TOL
    tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    _, raw = checkpoint.oracle(tokens, torch.cat([features[:, :7], out[:, -1:]], dim=1))
    normed_out = checkpoint._norm(out[:, -1:], "shared_head.norm")
    _, normed = checkpoint.oracle(tokens, torch.cat([features[:, :7], normed_out], dim=1))
    assert float((raw[0, -1] - normed[0, -1]).abs().max()) > 100 * TOL


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_greedy_with_the_mtp_layer_equals_target_only_greedy(pairs, batch):
    """Chains k = 1..4 and a tree, ragged prompts, the checkpoint's own random MTP layer."""
    pair = pairs["routed"]
    prompts = _prompts(batch, seed=batch + 200, vocab=V)
    expected = [naive_greedy(pair.target, p, 12) for p in prompts]
    generator = SpeculativeGenerator(pair.target, pair.draft)
    for k in (1, 2, 3, 4):
        result = generator.generate(prompts, 12, FixedK(k))
        assert result.token_ids == expected, k
        assert set(result.stats.k_per_step) == {k}
    assert generator.generate(prompts, 12, _tree_policy(TREES[1])).token_ids == expected


@pytest.fixture(scope="module")
def echo(checkpoints):
    """The routed checkpoint made an echo (every layer's attention and MLP outputs zeroed: the next token is a
    function of the current one) with an MTP layer that computes it from the token embedding (eh_proj keeps the
    embedding half, the layer adds nothing, its LM head and norm the target's) through a perturbed enorm: right
    about half the time, so drafts are accepted and rejected and every branch of the bookkeeping runs."""
    pair = _pair(checkpoints["routed"].directory)
    target, head = pair.target, pair.draft
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # a module fixture: outside the tests' no_grad
        for layer in [*target.layers, *head.layers]:
            layer.o.weight.zero_()
            if layer.experts is None:
                layer.down.weight.zero_()
            else:
                layer.experts.down.zero_()
                layer.experts.shared_down.weight.zero_()
        head.input_proj.weight.zero_()
        head.input_proj.weight[:, :D].copy_(torch.eye(D))
        head.own_embed.weight.copy_(target.embed.weight)
        head.shared_head.weight.copy_(target.lm_head.weight)
        head.final_norm.weight.copy_(target.final_norm.weight)
        head.token_norm.weight.copy_(1.0 + 0.2 * torch.randn(D, generator=gen))
    return target, head


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_with_an_accepting_mtp_layer_stays_lossless(echo, k):
    target, head = echo
    prompts = _prompts(8, seed=3, vocab=V)
    result = SpeculativeGenerator(target, head).generate(prompts, 20, FixedK(k))
    assert result.token_ids == [naive_greedy(target, p, 20) for p in prompts]
    assert 0.3 < result.stats.acceptance_per_position[0] < 1.0  # right often, wrong sometimes


@pytest.mark.parametrize("spec", TREES)
def test_greedy_trees_with_an_accepting_mtp_layer_stay_lossless(echo, spec):
    target, head = echo
    prompts = _prompts(8, seed=13, vocab=V)
    result = SpeculativeGenerator(target, head).generate(prompts, 20, _tree_policy(spec))
    assert result.token_ids == [naive_greedy(target, p, 20) for p in prompts]
    assert max(result.stats.acceptance_per_position[1:] or [0]) > 0


def test_each_steps_chain_and_tree_equal_the_mtp_layer_recomputed_from_scratch(echo):
    """The drafts of every chain step and every node of every tree step against the head recomputed on a fresh
    cache (test_runtime_heads' oracles): its cache, roll-back and carried output (before its norm) are right."""
    from specbatch.perfmodel.tree import parse_tree

    target, head = echo
    seen, original_chain, original_tree = [], HeadDrafter.chain, HeadDrafter.tree

    def committed(state):
        return [state.tokens[r, :int(state.host_committed[r])].tolist() for r in range(state.batch_size)]

    def chain(self, state, k, passes):
        tokens, probs = original_chain(self, state, k, passes)
        seen.append(("chain", committed(state), tokens.tolist()))
        return tokens, probs

    def tree(self, state, plan, staged, passes):
        drafted = original_tree(self, state, plan, staged, passes)
        seen.append(("tree", committed(state), drafted.tokens.tolist()))
        return drafted

    HeadDrafter.chain, HeadDrafter.tree = chain, tree
    try:
        SpeculativeGenerator(target, head).generate(_prompts(4, seed=9, vocab=V), 14, FixedK(3))
        SpeculativeGenerator(target, head).generate(_prompts(4, seed=19, vocab=V), 14, _tree_policy(TREES[1]))
    finally:
        HeadDrafter.chain, HeadDrafter.tree = original_chain, original_tree
    assert {kind for kind, _, _ in seen} == {"chain", "tree"} and len(seen) >= 8
    shape = parse_tree(TREES[1])
    for kind, rows, drafted in seen:
        for row, tokens in zip(rows, drafted):
            fresh = _fresh_drafts(target, head, row, 3) if kind == "chain" else _fresh_tree(target, head, row, shape)
            assert tokens == fresh, kind


def test_chains_trees_and_k0_steps_mixed_with_the_mtp_layer_stay_lossless(echo):
    from specbatch.perfmodel.tree import Strategy, parse_tree

    target, head = echo
    choices = [Strategy(parse_tree(TREES[1])), 0, 3, Strategy(parse_tree(TREES[0])), 1, 0]

    class Turning:
        max_k, calls = 7, 0

        def __call__(self, batch_size, context_len=None):
            self.calls += 1
            return choices[(self.calls - 1) % len(choices)]

        def describe(self):
            return "trees, chains and k = 0 in turn"

    prompts = _prompts(6, seed=23, vocab=V)
    result = SpeculativeGenerator(target, head).generate(prompts, 20, Turning())
    assert result.token_ids == [naive_greedy(target, p, 20) for p in prompts]
    assert 0 in result.stats.k_per_step


def test_graphed_passes_of_the_mtp_layer_give_the_eager_run(echo, monkeypatch):
    """The head's graph keys (a drafting pass, the pass over each step's k + 1 verified positions) captured on the
    CPU through the stand-in capture: tokens and acceptance as the eager run's."""
    from test_runtime_cuda_graphs import stand_in_graphs
    from test_runtime_head_graphs import TurningK

    target, head = echo
    captured = stand_in_graphs(monkeypatch, (target, head))
    prompts = _prompts(5, seed=31, vocab=V)
    eager = SpeculativeGenerator(target, head, cuda_graphs=False).generate(prompts, 16, TurningK())
    generator = SpeculativeGenerator(target, head, cuda_graphs=True)
    graphed = generator.generate(prompts, 16, TurningK())
    assert graphed.token_ids == eager.token_ids == [naive_greedy(target, p, 16) for p in prompts]
    assert graphed.stats.accepted_per_position == eager.stats.accepted_per_position
    assert generator.drafter.runner.stats()["captures"] > 0 and captured


@pytest.mark.gpu
def test_a_graphed_mtp_layer_matches_eager_on_a_gpu(echo):
    """On CUDA in bfloat16 the expert layers run torch's grouped GEMM, which a graph captures."""
    from test_runtime_head_graphs import graphed_equals_eager_on_a_gpu

    graphed_equals_eager_on_a_gpu(*echo)


def test_calibration_times_and_counts_the_mtp_layer(pairs):
    """HeadPasses (what calibration times): a drafting pass gives logits over the vocabulary, the pass over a
    verify's positions none. ModelInfo (calibrate.models' head path): one layer, drafter mtp, and `parameters`
    what the head holds but its embeddings, with the LM head (its own or the target's) and every routed expert."""
    from specbatch.calibrate.models import model_info

    for variant, pair in pairs.items():
        head = pair.draft
        passes, cache = HeadPasses(head), head.new_cache(3, 16)
        assert passes(torch.zeros(3, 4, dtype=torch.long), cache) is None
        assert passes(torch.zeros(3, 1, dtype=torch.long), cache).shape == (3, 1, V)
        info = model_info(pair.draft_spec, torch.float32)
        assert (info.drafter, info.layers, info.model_type, info.vocab_size) == ("mtp", 1, "glm4_moe", V)
        held = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("own_embed"))
        lm_head = 0 if head.shared_head is not None else pair.target.lm_head.weight.numel()
        assert info.parameters == head.head_config.parameter_count() == held + lm_head, variant
        assert info.weight_bytes == 4 * info.parameters


def _six_token_target_and_mtp(peaked):
    """The sampling tests' 6-token GLM-4.5 target (test_runtime_sampling's moe_pair) carrying a random MTP layer."""
    from test_runtime_sampling import V as SIX

    raw = dict(model_type="glm4_moe", vocab_size=SIX, hidden_size=16, intermediate_size=32, num_attention_heads=2,
               num_key_value_heads=1, head_dim=8, max_position_embeddings=64, num_experts_per_tok=2,
               num_hidden_layers=2, n_routed_experts=8, moe_intermediate_size=16, first_k_dense_replace=1, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=1)
    config = config_from_dict(raw)
    target = peaked(build_model(config, seed=25), 15.0)
    routers = torch.Generator().manual_seed(26)
    for layer in target.layers[1:]:
        layer.experts.router.weight.normal_(0, 1.0, generator=routers)
    head = random_head(target_mtp_config(raw, config, "six/config.json"), target, seed=27)
    head.layers[0].experts.router.weight.normal_(0, 1.0, generator=routers)
    return target, head


class _HeadAsModel:
    """The head's distribution of the token after each position of whole sequences, as a model's logits (what
    test_runtime_sampling's `_exact` reads): the entry at slot s pairs token s + 1 with the target's state at s,
    and its output gives the token after position s + 1."""

    def __init__(self, target, head):
        self.target, self.head = target, head

    def __call__(self, seqs: torch.Tensor) -> torch.Tensor:
        _, features = self.target(seqs[:, :-1], None, features=self.head.head_config.feature_layers)
        logits, _ = self.head(seqs[:, 1:], features, self.head.new_cache(len(seqs), seqs.shape[1]))
        return torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)


@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_sampling_with_the_mtp_layer_is_exactly_the_targets(peaked, policy):
    """test_runtime_sampling's exact test: the first three tokens of 5000 rows follow the target's exact joint
    distribution (chi-square), with k = 2 chains or a tree; the draft's proposals are accepted and rejected, and a
    verifier that accepted every draft would be rejected by the same test."""
    from test_runtime_sampling import ALPHA, PROMPT, ROWS, _chi2_pvalue, _counts, _exact, _rejects, _wrong_second_token

    target, head = _six_token_target_and_mtp(peaked)
    sampling = Sampling(temperature=1.0)
    p1, p2, p3 = _exact(target, sampling)
    chosen = FixedK(2) if policy == "chain" else _tree_policy("0,1,0.0")
    result = SpeculativeGenerator(target, head).generate([PROMPT] * ROWS, 3, chosen, sampling, seed=1357)
    assert 0.1 < result.stats.acceptance_per_position[0] < 0.95
    counts3 = _counts(result.token_ids, 3)
    assert _chi2_pvalue(counts3, (p1[:, None, None] * p2[:, :, None] * p3).numpy()) > ALPHA
    if policy == "chain":
        _, q2, _ = _exact(_HeadAsModel(target, head), sampling)
        wrong = (p1[:, None] * _wrong_second_token(p2, q2, "accept_all")).numpy()
        assert _rejects(counts3.sum(2), wrong / wrong.sum())


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_glm4_moe_target_without_an_mtp_layer_is_refused_in_one_line(checkpoints, tmp_path):
    config = json.loads((checkpoints["routed"].directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UsageError, match="--draft mtp: .*num_nextn_predict_layers is 0 or absent") as caught:
        resolve_pair(str(tmp_path / "config.json"), "mtp")
    _one_line(caught)
    del config["num_nextn_predict_layers"]
    with pytest.raises(HeadError, match="0 or absent"):
        target_mtp_config(config, config_from_dict(config), "glm/config.json")


def test_a_target_of_another_family_is_refused_in_one_line(tmp_path, llama_config_factory):
    raw = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
               num_hidden_layers=2, max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match="read for glm4_moe targets .* this target is 'llama'") as caught:
        resolve_pair(str(tmp_path / "config.json"), "mtp")
    _one_line(caught)


def test_a_checkpoint_missing_an_mtp_tensor_or_holding_an_unknown_one_is_refused_in_one_line(checkpoints, tmp_path):
    from safetensors.torch import save_file

    source = checkpoints["routed"].directory
    directory = tmp_path / "glm"
    shutil.copytree(source, directory)
    name = f"model.layers.{LAYERS}.hnorm.weight"
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"].pop(name)
    tensors = _shards(directory)[shard]
    hnorm = tensors.pop(name)
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    with pytest.raises(HeadError, match=f"tensor '{name}' is missing") as caught:
        _pair(directory)
    assert "MTP layer's weights (layer 2)" in _one_line(caught)
    # named by the index, absent from its shard: missing too
    index["weight_map"][name] = shard
    index_file.write_text(json.dumps(index))
    with pytest.raises(HeadError, match=f"tensor '{name}' is missing"):
        _pair(directory)
    # a tensor of the layer the config does not describe (a ninth expert)
    tensors.update({name: hnorm, f"model.layers.{LAYERS}.mlp.experts.8.down_proj.weight": torch.zeros(D, 16)})
    index["weight_map"][f"model.layers.{LAYERS}.mlp.experts.8.down_proj.weight"] = shard
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    with pytest.raises(HeadError, match="1 tensor.* its config does not describe.*experts.8") as caught:
        _pair(directory)
    _one_line(caught)


@pytest.mark.parametrize("named", ["config.json", "preset"])
def test_a_random_mtp_layer_for_a_target_of_random_weights(checkpoints, named, monkeypatch):
    """A target named by its config.json or a shape preset (random weights: timing before the weights exist) drafts
    with a random MTP layer of its shape, with the target's embeddings and LM head."""
    from specbatch.runtime import presets

    file = checkpoints["routed"].directory / "config.json"
    if named == "preset":
        monkeypatch.setitem(presets.PRESETS, "tiny-glm", json.loads(file.read_text()))
    target_spec, draft_spec = resolve_pair("tiny-glm" if named == "preset" else str(file), "mtp")
    assert draft_spec.random_weights and draft_spec.head.layout == TARGET_MTP
    assert draft_spec.source == target_spec.source and draft_spec.head.layer.routes_experts(0)
    pair = load_pair(target_spec, draft_spec, "cpu", torch.float32)
    assert pair.draft.own_embed is None and pair.draft.shared_head is None
    prompts = _prompts(3, seed=5, vocab=V)
    assert SpeculativeGenerator(pair.target, pair.draft).generate(prompts, 8, FixedK(2)).token_ids == [
        naive_greedy(pair.target, p, 8) for p in prompts]


def test_routing_of_the_mtp_layer_reads_only_the_experts_its_tokens_route_to(pairs, monkeypatch):
    """The MTP layer's experts are the runtime's RoutedExperts: a one-token drafting pass with every expert no token
    routes to poisoned gives the same logits."""
    head = _pair(pairs["routed"].target_spec.directory).draft
    experts = head.layers[0].experts
    routed: set[int] = set()
    route = RoutedExperts.route

    def recording(self, x):
        chosen, weights = route(self, x)
        routed.update(chosen.flatten().tolist())
        return chosen, weights

    monkeypatch.setattr(RoutedExperts, "route", recording)
    cache = head.new_cache(1, 8)
    hidden = torch.randn(1, 1, D, generator=torch.Generator().manual_seed(4))
    before, _ = head(torch.tensor([[5]]), hidden, cache, last=1, from_target=False)
    untouched = sorted(set(range(8)) - routed)
    assert untouched
    experts.gate_up.data[untouched] = float("nan")
    experts.down.data[untouched] = float("nan")
    cache.set_lengths(None, [0])
    after, _ = head(torch.tensor([[5]]), hidden, cache, last=1, from_target=False)
    assert torch.isfinite(after).all() and torch.equal(after, before)


def test_head_config_fields(checkpoints):
    raw = json.loads((checkpoints["routed"].directory / "config.json").read_text())
    target = config_from_dict(raw)
    config = target_mtp_config(raw, target, "glm/config.json")
    assert config.layer.expert_layers == (True,) and config.layer.mtp_layers == 0
    assert config.draft_vocab_size == V and config.describe() == "the target's MTP layer (width 32, 8 experts top-2)"
    with pytest.raises(HeadError, match="num_nextn_predict_layers is 2"):
        target_mtp_config(raw, replace(target, mtp_layers=2), "glm/config.json")


def test_a_table_for_the_mtp_layer_exports_the_target_as_the_engines_mtp_checkpoint(pairs):
    """The profile's draft is the target's directory with drafter mtp: vLLM's method mtp loads that checkpoint's MTP
    layer (`model`: the target), and TensorRT-LLM's MTPDecodingConfig reads it from the same checkpoint."""
    from specbatch.perfmodel.table import Bucket, Table, TableEntry, to_trtllm, to_vllm

    spec = pairs["routed"].draft_spec
    entries = tuple(TableEntry(b, k, 100.0 * b, 1.5, None, None) for b, k in enumerate([3, 3, 2, 1], start=1))
    table = Table(pairs["routed"].target_spec.source, spec.source, "cpu", "2026-12-06T00:00:00Z", 3,
                  {"source": "user", "per_position": [0.8]}, (Bucket(2048, entries),), drafter=spec.drafter)
    vllm = to_vllm(table)
    assert (vllm["method"], vllm["model"], vllm["num_speculative_tokens"]) == ("mtp", spec.source, 3)
    trtllm = to_trtllm(table)
    assert (trtllm["decoding_type"], trtllm["speculative_model"]) == ("MTP", spec.source)
