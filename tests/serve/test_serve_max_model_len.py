"""`serve --max-model-len N` sizes every KV slot for N tokens (prompt + max_tokens), not the models' whole
context: the pool is max-batch-size x (N + one step's draft margin), and longer requests are refused."""
from __future__ import annotations

import pytest

from specbatch.runtime.engine import EngineError
from specbatch.serve.server import ServeError, ServeOptions, build


def test_the_slots_are_sized_for_max_model_len():
    runner, _ = build(ServeOptions(k=3, max_batch_size=4, max_model_len=64))
    engine = runner.engine
    assert engine.max_context_tokens == 64
    assert engine._pool.target_cache.batch_size == 4 and engine._pool.target_cache.max_len == 64 + 3 + 1
    assert engine._pool.draft_cache.max_len == 64 + 3 + 1
    engine.check(40, 24)  # 64 tokens: fits
    with pytest.raises(EngineError, match="64"):
        engine.check(40, 25)
    default, _ = build(ServeOptions(k=3, max_batch_size=4))
    assert default.engine.max_context_tokens == default.engine.generator.context_limit - 3


def test_a_length_past_the_models_context_is_one_line_naming_the_option():
    with pytest.raises(ServeError, match=r"^--max-model-len 1000000: the models hold 1024 positions") as error:
        build(ServeOptions(k=3, max_batch_size=4, max_model_len=10**6))
    assert "\n" not in str(error.value)
    with pytest.raises(EngineError, match=r"exceed the models' context of 1024 positions"):  # no room for k = 3
        build(ServeOptions(k=3, max_batch_size=4, max_model_len=1022))


def test_the_kv_cache_size_caps_the_running_requests_at_the_slots_that_fit():
    """--kv-cache-gb sizes the pool: slots of (N + draft margin) tokens x both models' bytes per token."""
    probe, _ = build(ServeOptions(k=3, max_batch_size=4, max_model_len=64))
    slot_bytes = (64 + 3 + 1) * probe.engine.kv_bytes_per_token()
    assert probe.engine.kv_bytes_per_token() == 2 * 4 * (6 * 4 * 64 + 1 * 3 * 64)  # demo pair, float32: by hand
    runner, _ = build(ServeOptions(k=3, max_batch_size=32, max_model_len=64, kv_cache_gb=2.5 * slot_bytes / 2**30))
    assert runner.engine.max_batch_size == 2 and runner.engine._pool.target_cache.batch_size == 2
    with pytest.raises(ServeError, match=r"^--kv-cache-gb: one KV slot of 68 tokens takes .* GiB") as error:
        build(ServeOptions(k=3, max_batch_size=4, max_model_len=64, kv_cache_gb=0.5 * slot_bytes / 2**30))
    assert "\n" not in str(error.value)
    with pytest.raises(ServeError, match=r"^--kv-cache-gb must be > 0"):
        build(ServeOptions(k=3, max_model_len=64, kv_cache_gb=0.0))


def test_cuda_graphs_on_a_cpu_are_one_line():
    with pytest.raises(ServeError, match=r"^CUDA graphs need a CUDA device, got --device cpu$"):
        build(ServeOptions(k=3, max_model_len=64, cuda_graphs=True, device="cpu"))


@pytest.mark.parametrize("max_batch_size", [4, 100000])
def test_a_kv_cache_past_the_free_memory_is_one_line_naming_the_option(monkeypatch, max_batch_size):
    """The KV slots are allocated at start: --kv-cache-gb is checked against the memory free after loading the
    models (the memory plans' 90 % of it), not left to an allocation that fails or a machine that swaps."""
    from specbatch.calibrate import environment

    monkeypatch.setattr(environment, "available_memory_bytes", lambda device: 2**30)
    with pytest.raises(ServeError, match=r"^--kv-cache-gb 100000: 1 GiB are free on cpu after loading the models, "
                                         r"and the KV cache may take 0.9 GiB of it \(90 %\)") as error:
        build(ServeOptions(k=3, max_batch_size=max_batch_size, max_model_len=64, kv_cache_gb=100000))
    assert "\n" not in str(error.value)
    runner, _ = build(ServeOptions(k=3, max_batch_size=4, max_model_len=64, kv_cache_gb=0.85))  # within the 90 %
    assert runner.engine.max_batch_size == 4


def test_serve_refuses_a_kv_cache_no_machine_has_in_one_line():
    from cli_helpers import assert_one_line_error, invoke

    result = invoke("serve", "--k", "3", "--port", "0", "--kv-cache-gb", "100000", "--max-batch-size", "100000")
    assert_one_line_error(result, "--kv-cache-gb 100000:", "GiB are free on cpu")
