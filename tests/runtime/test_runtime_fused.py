"""The fused layer (runtime.fused) compiled by torch.compile on the CPU (inductor's C++ backend) computes what
the eager layer computes: logits within float32 rounding over a prefill, a decode, a verify and a tree pass,
on the sdpa backend and on the varlen backend's code (its CPU reference kernel), for a plain Llama and a layer
with every switch the fused functions take (Qwen3's query and key norms, partial rotary, a query scale); and
speculative greedy output equal to target-only greedy. Oracle: the eager layer, itself tested against
transformers."""
from __future__ import annotations

import pytest
import torch

from specbatch.runtime import fused
from specbatch.runtime.attention import TreeAttention
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.devices import why_layers_unfused
from specbatch.runtime.devices.cpu import why_no_compiler
from specbatch.runtime.generator import SpeculativeGenerator
from torch_fixtures import tiny_llama_config

compiler = pytest.mark.skipif(why_no_compiler() is not None, reason="torch.compile needs a C++ compiler here")

CONFIGS = {
    "llama": {},
    "every switch": dict(qk_norm=True, rotary_dim=4, query_scale=0.3),
}
PROMPTS = (6, 13, 2)


def _pair(config: dict, backend: str):
    eager = build_model(tiny_llama_config(**config), "cpu", torch.float32, seed=5)
    compiled = build_model(tiny_llama_config(**config), "cpu", torch.float32, seed=5)
    eager.layer_kernels, compiled.layer_kernels = None, fused.compiled_kernels()
    eager.attention_backend = compiled.attention_backend = backend
    return eager, compiled


def _passes(model):
    """Logits of a ragged prefill, a decode, a 4-token verify and a 2-node tree pass, in that order."""
    generator = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    cache = model.new_cache(len(PROMPTS), 40)
    out = [model(torch.randint(0, vocab, (sum(PROMPTS),), generator=generator), cache, last=1,
                 new_tokens=list(PROMPTS))]
    out.append(model(torch.randint(0, vocab, (3, 1), generator=generator), cache))
    out.append(model(torch.randint(0, vocab, (3, 4), generator=generator), cache))
    tree = TreeAttention(torch.tensor([0, 1]), torch.tensor([[True, False], [True, True]]))
    out.append(model(torch.randint(0, vocab, (3, 2), generator=generator), cache, tree))
    return out


@compiler
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_compiled_layer_computes_what_the_eager_layer_computes(name, backend, monkeypatch):
    if backend == "varlen":
        import varlen_reference

        varlen_reference.use_reference_flash(monkeypatch)
    eager, compiled = _pair(CONFIGS[name], backend)
    with torch.inference_mode():
        expected, got = _passes(eager), _passes(compiled)
    for step, (want, have) in enumerate(zip(expected, got)):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"pass {step}: {m}")


@compiler
def test_speculative_greedy_with_compiled_layers_is_target_only_greedy(monkeypatch):
    from specbatch.runtime.policy import FixedK

    target = build_model(tiny_llama_config(num_layers=3), "cpu", torch.float32, seed=2)
    draft = build_model(tiny_llama_config(num_layers=1), "cpu", torch.float32, seed=3)
    for model in (target, draft):
        with torch.no_grad():
            model.lm_head.weight.mul_(40.0)  # peaked logits: argmax gaps dwarf float rounding
        model.layer_kernels = fused.compiled_kernels()
    prompts = [[5, 9, 2, 7], [1, 3], [8, 8, 8, 1, 2, 6, 4]]
    generator = SpeculativeGenerator(target, draft, eos_token_ids=())
    speculative = generator.generate(prompts, 12, FixedK(3)).token_ids
    target.layer_kernels = None
    plain = SpeculativeGenerator(target, None, eos_token_ids=()).generate(prompts, 12, FixedK(0)).token_ids
    assert speculative == plain


def test_a_function_whose_compile_fails_runs_eager_from_then_on(caplog):
    calls = []

    def failing_compile(*args):
        calls.append(args)
        raise RuntimeError("triton: out of shared memory on this shape")

    wrapped = fused._CompiledOrEager(fused.gated, failing_compile)
    gate_up = torch.randn(3, 8)
    with caplog.at_level("WARNING", logger="specbatch.runtime"):
        first, second = wrapped(gate_up, torch.sigmoid), wrapped(gate_up, torch.sigmoid)
    assert torch.equal(first, fused.gated(gate_up, torch.sigmoid)) and torch.equal(second, first)
    assert len(calls) == 1 and "runs eager from now on" in caplog.text


def test_the_device_records_say_where_layers_fuse():
    assert why_layers_unfused("cpu") is not None  # the CPU's eager layer is the tuned one
    assert fused.kernels_for("cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_layer_replayed_in_graphs_computes_what_the_eager_layer_computes():
    """bfloat16 on the GPU: the fused kernels (triton) by the device's record, inside captured graphs, against
    the eager layer run eagerly."""
    from specbatch.runtime.cuda_graphs import GraphedModel

    if why_layers_unfused("cuda") is not None:
        pytest.skip(why_layers_unfused("cuda"))
    eager = build_model(tiny_llama_config(**CONFIGS["every switch"]), "cuda", torch.bfloat16, seed=5)
    fused_model = build_model(tiny_llama_config(**CONFIGS["every switch"]), "cuda", torch.bfloat16, seed=5)
    eager.layer_kernels = None
    graphed = GraphedModel(fused_model)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, eager.config.vocab_size, (sum(PROMPTS),), generator=generator).cuda()
    steps = [torch.randint(0, eager.config.vocab_size, (3, n), generator=generator).cuda() for n in (1, 4, 1, 4)]
    outputs = []
    for runner in (eager, graphed):
        cache = runner.new_cache(len(PROMPTS), 128)
        with torch.inference_mode():
            runner(prompt, cache, last=1, new_tokens=list(PROMPTS))
            outputs.append([runner(tokens, cache).float().cpu() for tokens in steps])
    assert fused_model.fused_kernels() is not None and graphed.stats()["captures"] > 0
    for want, have in zip(*outputs):
        torch.testing.assert_close(have, want, atol=5e-2, rtol=5e-2)


def test_a_server_compiles_the_prefills_kernels_before_its_first_request(greedy_target, greedy_draft_sometimes,
                                                                          monkeypatch):
    """Graphs cover decode and verify passes; the packed (tokens, hidden) shapes a prefill gives the fused
    functions are met by a warm prefill at start-up, undone, so no request's prefill compiles."""
    from specbatch.runtime.engine import Engine, EngineConfig
    from specbatch.runtime.policy import FixedK
    from test_runtime_cuda_graphs import stand_in_graphs

    stand_in_graphs(monkeypatch, (greedy_target, greedy_draft_sometimes))
    ranks = []

    def recording(function):
        def run(x, *args):
            ranks.append(x.dim())
            return function(x, *args)
        return run

    kernels = fused.LayerKernels(recording(fused.add_norm), recording(fused.norm), fused.gated,
                                 fused.queries_and_keys, fused.in_flight_merge, compiled=True)
    for model in (greedy_target, greedy_draft_sometimes):
        monkeypatch.setattr(model, "layer_kernels", kernels)
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, cuda_graphs=True)
    engine = Engine(generator, FixedK(2), EngineConfig(max_batch_size=3))
    assert 2 in ranks and 3 in ranks  # a packed prefill and the graphs' uniform passes, before any request
    assert engine.running == 0 and greedy_target.fused_kernels() is kernels
    for cache in (engine._pool.target_cache, engine._pool.draft_cache):
        assert cache.host_lengths.tolist() == [0, 0, 0]  # the warm prefill undone
