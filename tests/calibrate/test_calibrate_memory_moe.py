"""A mixture-of-experts pass's transient memory (calibrate.memory.expert_layer_bytes, pass_bytes) against the peak
torch's profiler measures on tiny models on this CPU, and the one-line refusal of weights that cannot fit, said
before anything is allocated.

Oracle: the CPU allocator's own timeline (torch.profiler's memory timeline: every allocation and free of the
pass), whose peak above what was alive before the pass is what the pass holds at once."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.memory import GIB, expert_layer_bytes, memory_budget, pass_bytes
from specbatch.calibrate.models import model_info
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.config import config_from_dict
from specbatch.runtime.loading import ModelSpec, resolve_model

SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=512, tie_word_embeddings=False)
# one of each router: Qwen3-MoE's weights in the model's dtype, Mixtral's (experts as wide as 2 x hidden: the
# gated products outweigh the weighting) and GLM-4.5's in float32, GLM's first layer dense and a shared expert
FAMILIES = {
    "qwen3_moe": dict(SMALL, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
                      norm_topk_prob=True),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=128),
    "glm4_moe": dict(SMALL, model_type="glm4_moe", n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
}
DTYPES = (torch.float32, torch.bfloat16)


def peak_bytes(run, tmp_path) -> int:
    """What `run()` holds at once beyond what was alive when it started (the CPU allocator's timeline)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run()
    path = tmp_path / "timeline.json"
    with warnings.catch_warnings():  # torch 2.13 calls it deprecated (in favour of CUDA-only snapshots)
        warnings.simplefilter("ignore", FutureWarning)
        prof.export_memory_timeline(str(path), device="cpu")
    _, sizes = json.loads(path.read_text())  # [times, bytes by category at each time]
    totals = [sum(row) for row in sizes]
    return max(totals) - totals[0]


def tiny(family: str, dtype: torch.dtype):
    config = config_from_dict(FAMILIES[family])
    return build_model(config, "cpu", dtype), model_info(ModelSpec("target", family, config, None), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_an_expert_layer_holds_what_is_counted_on_either_path(family, dtype, tmp_path):
    """Expert by expert (a CPU) and through the grouped GEMM (CUDA in bfloat16; torch's CPU kernel here): the count
    covers both and is the larger of the two within 5 % (what it leaves out: the router's scores, freed before)."""
    torch.manual_seed(0)
    model, info = tiny(family, dtype)
    layer = next(block.experts for block in model.layers if block.experts is not None)
    tokens = 256
    x = torch.randn(tokens, info.hidden_size, dtype=dtype)
    paths = [False] + ([True] if hasattr(torch, "_grouped_mm") else [])
    measured = []
    with torch.inference_mode():
        for grouped in paths:
            layer.grouped_products = grouped
            layer(x)  # once before: nothing lazily built inside the measured call
            measured.append(peak_bytes(lambda: layer(x), tmp_path))
    counted = expert_layer_bytes(info, tokens)
    assert max(measured) <= counted <= 1.05 * max(measured), (measured, counted)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixture_of_experts_pass_holds_no_more_than_counted(family, dtype, tmp_path):
    """A cached pass of 4 rows x 64 tokens, logits at every position (as calibration's verify passes): measured
    within the count, which a dense MLP's count (the gate and up of `intermediate_size`) misses for Qwen3-MoE and
    GLM-4.5, whose experts' k rows a token outweigh one dense MLP."""
    torch.manual_seed(0)
    model, info = tiny(family, dtype)
    rows, new_tokens, context = 4, 64, 32
    cache = model.new_cache(rows, context + new_tokens)
    tokens = torch.randint(0, info.vocab_size, (rows, new_tokens))

    def run():
        cache.set_lengths(None, [context] * rows)
        model(tokens, cache, None, None)

    with torch.inference_mode():
        run()
        measured = peak_bytes(run, tmp_path)
    counted = pass_bytes(info, rows, new_tokens, context + new_tokens, rows * new_tokens, False)
    assert measured <= counted <= 2.5 * measured, (measured, counted)
    if family != "mixtral":
        assert pass_bytes(replace(info, experts=None), rows, new_tokens, context + new_tokens, rows * new_tokens,
                          False) < measured


def _infos(target: str, draft: str, dtype: torch.dtype):
    return (model_info(resolve_model(target, "target"), dtype), model_info(resolve_model(draft, "draft"), dtype))


def test_weights_that_cannot_fit_are_refused_in_one_line_with_where_to_time_them():
    target, draft = _infos("qwen3-235b-a22b", "qwen3-0.6b", torch.bfloat16)
    with pytest.raises(CalibrationError) as error:
        memory_budget(target, draft, 24 * GIB, "cpu")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("--target qwen3-235b-a22b (437.9 GiB) and --draft qwen3-0.6b (1.1 GiB): the weights "
                              "need 439.0 GiB at 2 bytes a parameter, and 24.0 GiB are free on cpu (90 % of it "
                              "planned); time the pair on a GPU with more than 488 GiB free")
    assert "--from-vidur" not in message  # vidur's timings are of dense blocks: no experts
    # a dense pair in float32 that bfloat16 would fit: both ways, and vidur's composition
    target, draft = _infos("llama-3.1-8b", "llama-3.2-1b", torch.float32)
    with pytest.raises(CalibrationError, match=r"time the pair with --dtype bfloat16 \(17.3 GiB\), on a GPU with more "
                                               r"than 20 GiB free or from published GPU timings with calibrate "
                                               r"--from-vidur DIR$"):
        memory_budget(target, draft, 24 * GIB, "cpu")
