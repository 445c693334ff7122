"""Mixture-of-experts shape presets (runtime.presets): their sizes against the model cards, the fields the runtime
reads from them, and gpt-oss, kept as a shape and refused in one line when selected.

Oracles: the total and active parameters each model card publishes. Cards differ in which embedding tables they
count as active: the counts below follow each card (Mixtral's and Qwen3's count both, GLM-4.5's neither, gpt-oss's
the unembedding only). gpt-oss's count is the test's own, from the tensors its checkpoint lists (q, k, v and o
with biases, a sink per head, a router with a bias, experts with biases), since the runtime refuses the family."""
from __future__ import annotations

import pytest

from specbatch.perfmodel.errors import UsageError
from specbatch.runtime.loading import resolve_model
from specbatch.runtime.presets import PRESETS, preset_config


# preset -> (total, active, embedding tables the card counts as active), in billions. Active counts are checked
# within 2 %: the cards give two figures, rounded or cut (Qwen3-30B-A3B's 3.35B is published as 3.3B)
PUBLISHED = {
    "qwen3-30b-a3b": (30.5, 3.3, 2), "qwen3-235b-a22b": (235, 22, 2), "mixtral-8x7b": (46.7, 12.9, 2),
    "glm-4.5-air": (106, 12, 0), "gpt-oss-20b": (20.91, 3.61, 1), "gpt-oss-120b": (116.83, 5.13, 1),
}


def _gpt_oss_counts(raw: dict) -> tuple[int, int]:
    """(total, active) parameters of a gpt-oss shape, tensor by tensor as its checkpoint lists them."""
    d, width, vocab, layers = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"], raw["num_hidden_layers"]
    experts, top_k, heads = raw["num_local_experts"], raw["num_experts_per_tok"], raw["num_attention_heads"]
    q, kv = heads * raw["head_dim"], raw["num_key_value_heads"] * raw["head_dim"]
    attention = (d + 1) * q + 2 * (d + 1) * kv + (q + 1) * d + heads  # biases on q, k, v, o; one sink per head
    expert = (d + 1) * 2 * width + (width + 1) * d  # gate-up and down, with biases
    layer = attention + (d + 1) * experts + experts * expert + 2 * d  # router with a bias, two norms
    total = layers * layer + 2 * vocab * d + d  # untied embedding and unembedding, the final norm
    return total, total - layers * (experts - top_k) * expert


def _counts(name: str) -> tuple[int, int, int]:
    """(total, active with every table, one embedding table) of a preset."""
    raw = PRESETS[name]
    if raw["model_type"] == "gpt_oss":
        return (*_gpt_oss_counts(raw), raw["vocab_size"] * raw["hidden_size"])
    config = preset_config(name)
    routed = sum(config.routes_experts(layer) for layer in range(config.num_layers))
    idle = routed * (config.num_experts - config.experts_per_token) * 3 * config.hidden_size * (
        config.expert_intermediate_size)
    total = config.parameter_count()
    return total, total - idle, config.vocab_size * config.hidden_size


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_moe_preset_counts_its_model_cards_parameters(name):
    total, active, table = _counts(name)
    published_total, published_active, tables = PUBLISHED[name]
    assert total / 1e9 == pytest.approx(published_total, rel=0.01)
    assert (active - (2 - tables) * table) / 1e9 == pytest.approx(published_active, rel=0.02)


def test_the_fields_the_runtime_reads_from_the_moe_presets():
    small, large = preset_config("qwen3-30b-a3b"), preset_config("qwen3-235b-a22b")
    for config, layers, width in ((small, 48, 768), (large, 94, 1536)):
        assert (config.num_layers, config.num_experts, config.experts_per_token) == (layers, 128, 8)
        assert config.expert_intermediate_size == width and all(config.expert_layers) and config.qk_norm
        assert config.normalize_expert_weights and config.num_kv_heads == 4 and config.sliding_window is None
    mixtral = preset_config("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert mixtral.rope_theta == 1e6 and mixtral.sliding_window is None and mixtral.normalize_expert_weights
    glm = preset_config("glm-4.5-air")
    assert glm.expert_layers == (False,) + (True,) * 45 and glm.intermediate_size == 10944  # layer 0 dense
    assert (glm.router, glm.routed_scaling_factor, glm.shared_expert_intermediate_size) == ("sigmoid", 1.0, 1408)
    assert (glm.rotary_dim, glm.qkv_bias, glm.o_bias, glm.qk_norm, glm.mtp_layers) == (64, True, False, False, 1)
    assert glm.eos_token_ids == (151329, 151336, 151338)


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_a_gpt_oss_preset_is_a_shape_refused_in_one_line_when_selected(name):
    from cli_helpers import assert_one_line_error, invoke

    with pytest.raises(UsageError) as error:
        resolve_model(name, "target")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"preset {name}: a gpt_oss shape the runtime does not run")
    assert message.endswith("the mixture-of-experts presets that run: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, "
                            "glm-4.5-air")
    # the family is refused when the name is resolved, before any memory is counted or weights are built
    assert_one_line_error(invoke("calibrate", "--target", name, "--draft", name, "--acceptance", "0.8"),
                          f"preset {name}: a gpt_oss shape")
