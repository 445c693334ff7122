"""Greedy losslessness per dtype (tests/lossless_helpers.py says what it means in each). float32 on every
device is exact (test_runtime_lossless.py); here, bfloat16 and float16: speculative against plain decoding in
the same dtype on the same device, the rate of first divergences reported, and each of them at a near tie
of the target's logits. Models with small random weights (logits of a few units), where ties happen."""
from __future__ import annotations

import pytest
import torch

from lossless_helpers import divergences_at_near_ties
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK

ROWS, NEW_TOKENS = 16, 40
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]


def _pair(config_factory, device: str, dtype: torch.dtype, family: str = "llama"):
    config = config_factory(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=128, max_position_embeddings=256)
    if family == "gemma3_text":  # float32 norms, an embedding scale rounded to the dtype, windows, a soft-cap
        from specbatch.runtime.config import config_from_dict

        config = config_from_dict(dict(
            model_type="gemma3_text", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256,
            query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=30.0))
    target = build_model(config, device, dtype, seed=5)
    draft = build_model(config.__class__(**{**config.__dict__, "num_layers": 1}), device, dtype, seed=6)
    return target, draft


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_speculative_parts_from_plain_decoding_only_at_near_ties(llama_config_factory, device, dtype, family,
                                                                 record_property):
    target, draft = _pair(llama_config_factory, device, dtype, family)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 30, (ROWS,), generator=generator)]
    plain = SpeculativeGenerator(target, None).generate(prompts, NEW_TOKENS, FixedK(0)).token_ids
    for k in (1, 4):
        speculative = SpeculativeGenerator(target, draft).generate(prompts, NEW_TOKENS, FixedK(k)).token_ids
        parted, bad = divergences_at_near_ties(target, prompts, plain, speculative)
        record_property(f"first_divergences_k{k}", f"{parted}/{ROWS}")
        print(f"{device} {dtype} k={k}: {parted} of {ROWS} rows part from plain decoding, all at near ties")
        assert bad == [], bad


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_float32_is_exact_where_lower_precision_may_part(llama_config_factory, family):
    """The same small-logit pair in float32: no row parts (the exact statement holds only here)."""
    target, draft = _pair(llama_config_factory, "cpu", torch.float32, family)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 30, (ROWS,), generator=generator)]
    plain = SpeculativeGenerator(target, None).generate(prompts, NEW_TOKENS, FixedK(0)).token_ids
    assert SpeculativeGenerator(target, draft).generate(prompts, NEW_TOKENS, FixedK(4)).token_ids == plain
