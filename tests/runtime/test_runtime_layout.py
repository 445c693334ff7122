"""What the CPU fast paths change and what they must not: projections stored transposed keep the
checkpoint's values (oracle: the safetensors file itself); the in-place residual and MLP of inference give
the autograd path's logits bit for bit; rows in a few spans of one length write the cache by
slices exactly where the scatter writes it."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from torch_fixtures import tiny_llama_config, tune_cpu
from specbatch.runtime.assembly import DEMO_TARGET
from specbatch.runtime.attention import UniformPass
from specbatch.runtime.checkpoint import build_model, load_checkpoint
from specbatch.runtime.kv_cache import KVCache


def test_cpu_projections_are_stored_transposed_with_the_checkpoints_values():
    model = load_checkpoint(DEMO_TARGET).model
    stored = load_file(str(DEMO_TARGET / "model.safetensors"))
    projections = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    assert len(projections) == 4 * model.config.num_layers
    for module in projections:
        weight = module.weight
        assert not weight.is_contiguous() and weight.t().is_contiguous()  # (in, out) storage
    block = model.layers[0]
    # the checkpoint's separate q/k/v and gate/up matrices, fused as the loader fuses them
    qkv = torch.cat([stored[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]).float()
    gate_up = torch.cat([stored[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")]).float()
    assert torch.equal(block.qkv.weight, qkv)
    assert torch.equal(block.gate_up.weight, gate_up)
    assert torch.equal(block.down.weight, stored["model.layers.0.mlp.down_proj.weight"].float())
    # the tied head still reads the embedding's rows, in the embedding's own storage
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.embed.weight.is_contiguous()


def test_untied_head_is_stored_transposed_too():
    model = build_model(tiny_llama_config(), seed=1)
    assert model.lm_head.weight.t().is_contiguous() and model.embed.weight.is_contiguous()


@pytest.mark.parametrize("cached", [False, True])
def test_in_place_inference_path_gives_the_autograd_paths_logits_exactly(cached):
    model = build_model(tiny_llama_config(), seed=2)
    tokens = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))

    def logits(grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            if not cached:
                return model(tokens).detach()
            cache = model.new_cache(3, 16)
            model(tokens[:, :5], cache)
            return model(tokens[:, 5:], cache).detach()

    with_autograd, in_place = logits(True), logits(False)
    assert torch.equal(with_autograd, in_place)


@pytest.mark.parametrize("lengths, spans", [
    ([6, 6, 6, 6], [(0, 4, 6)]),
    ([9, 6, 6, 6], [(0, 1, 9), (1, 4, 6)]),
    ([9, 6, 6, 2, 2, 3], [(0, 1, 9), (1, 3, 6), (3, 5, 2), (5, 6, 3)]),
])
@pytest.mark.parametrize("n", [1, 3])
def test_rows_in_spans_of_one_length_write_by_slices_where_the_scatter_writes(lengths, spans, n):
    config = tiny_llama_config()
    generator = torch.Generator().manual_seed(5)
    b = len(lengths)
    caches = [KVCache(config, b, 12, "cpu", torch.float32) for _ in range(2)]
    for cache in caches:
        cache.lengths = torch.tensor(lengths)
    sliced = UniformPass(caches[0], n, None, None, "sdpa")
    scattered = UniformPass(caches[1], n, None, None, "sdpa")
    assert sliced.spans == spans
    scattered.spans = None  # the general path, slots from the device lengths
    k = torch.randn(b, n, config.num_kv_heads, config.head_dim, generator=generator)
    v = torch.randn(b, n, config.num_kv_heads, config.head_dim, generator=generator)
    sliced.write(caches[0], 1, k, v)
    scattered.write(caches[1], 1, k, v)
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
    for r, length in enumerate(lengths):
        assert torch.equal(caches[0].keys[1, r, length:length + n], k[r])


def test_rows_of_many_lengths_keep_the_scatter():
    cache = KVCache(tiny_llama_config(), 5, 12, "cpu", torch.float32)
    cache.lengths = torch.tensor([6, 4, 6, 5, 4])
    assert UniformPass(cache, 1, None, None, "sdpa").spans is None


def _cut_cost(runs, call_keys: int, row_keys: int) -> int:
    return sum(call_keys + (end - start) * (row_keys + keys) for start, end, keys in runs)


@pytest.mark.parametrize("seed", range(6))
def test_planned_runs_are_the_cheapest_contiguous_cut(seed, monkeypatch):
    """Oracle: every way of cutting 7 rows into contiguous runs (2^6 of them), priced by the cost model."""
    import itertools

    import numpy as np

    from specbatch.runtime import attention

    kind = tune_cpu(monkeypatch, sdpa_call_keys=[8, 40, 160][seed % 3])
    rng = np.random.default_rng(seed)
    totals = rng.integers(1, 700, size=7)
    planned = attention.plan_runs(totals, kind)
    assert planned[0][0] == 0 and planned[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(planned, planned[1:]))
    assert all(keys == totals[start:end].max() for start, end, keys in planned)
    costs = []
    for cuts in itertools.product([False, True], repeat=6):
        edges = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [7]
        costs.append(_cut_cost([(s, e, int(totals[s:e].max())) for s, e in zip(edges, edges[1:])],
                               kind.sdpa_call_keys, kind.sdpa_row_keys))
    assert _cut_cost(planned, kind.sdpa_call_keys, kind.sdpa_row_keys) == min(costs)


def test_rows_take_their_slots_longest_prompt_first_and_answers_keep_the_callers_order():
    from specbatch.runtime.generator import SpeculativeGenerator, slot_order
    from specbatch.runtime.policy import FixedK

    prompts = [[5, 6], [1, 2, 3, 4], [7], [8, 9, 10, 11]]
    assert slot_order(prompts) == [1, 3, 0, 2]
    model = build_model(tiny_llama_config(), seed=3)
    generator = SpeculativeGenerator(model)
    together = generator.generate(prompts, 5, FixedK(0)).token_ids
    assert together == [generator.generate([p], 5, FixedK(0)).token_ids[0] for p in prompts]
