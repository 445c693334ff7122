"""bench plans its memory with calibration's accounting (calibrate.memory) before the first cache is allocated: a
batch size that cannot fit is refused in one line naming --batch-sizes, with the largest that does."""
from __future__ import annotations

import pytest

from cli_helpers import assert_one_line_error, invoke
from specbatch.bench.config import BenchError
from specbatch.bench.memory import BenchMemory, check_bench_memory, largest_fitting_batch, round_bytes
from specbatch.calibrate.memory import HEADROOM, MemoryBudget
from specbatch.perfmodel.profile import ModelInfo

GIB = 1024 ** 3


def _info(layers: int, hidden: int) -> ModelInfo:
    parameters = 12 * layers * hidden * hidden
    return ModelInfo(source="m", model_type="llama", random_weights=True, parameters=parameters, layers=layers,
                     hidden_size=hidden, heads=4, kv_heads=4, head_dim=hidden // 4, intermediate_size=4 * hidden,
                     vocab_size=1000, weight_bytes=4 * parameters, kv_bytes_per_token=2 * layers * hidden * 4,
                     max_position_embeddings=4096)


def _memory(free_bytes: int) -> BenchMemory:
    target, draft = _info(8, 512), _info(1, 256)
    return BenchMemory(MemoryBudget("cpu", free_bytes, target.weight_bytes + draft.weight_bytes), target, draft,
                       scores_materialized=True)


def test_the_largest_fitting_batch_fits_and_the_next_does_not():
    memory, ks = _memory(2 * GIB), [0, 1, 4]
    largest = largest_fitting_batch(memory, ks, 64, 32, together=True, graphs=False, below=10 ** 6)
    assert largest > 0
    assert memory.budget.fits(round_bytes(memory, largest, ks, 64, 32, True, False))
    assert not memory.budget.fits(round_bytes(memory, largest + 1, ks, 64, 32, True, False))
    check_bench_memory(memory, [1, largest], ks, 64, 32, together=True, graphs=False)  # no error
    with pytest.raises(BenchError, match=rf"--batch-sizes {largest + 1}: .* at most {largest} fits"):
        check_bench_memory(memory, [1, largest + 1], ks, 64, 32, together=True, graphs=False)


def test_lockstep_holds_every_policy_and_runs_one_at_a_time():
    memory, ks = _memory(2 * GIB), [0, 2, 8]
    together = round_bytes(memory, 64, ks, 64, 32, together=True, graphs=False)
    alone = round_bytes(memory, 64, ks, 64, 32, together=False, graphs=False)
    assert together > alone == round_bytes(memory, 64, [8], 64, 32, together=True, graphs=False)


def test_cli_refuses_a_batch_size_beyond_memory_in_one_line(tmp_path, monkeypatch):
    """Before the plan, b = 100000 died in the KV cache's allocation with a long traceback."""
    monkeypatch.setattr("specbatch.calibrate.environment.available_memory_bytes",
                        lambda device: int(4 * GIB / HEADROOM))
    result = invoke("bench", "--batch-sizes", "1,100000", "--threads", "1", "-o", tmp_path / "b")
    assert_one_line_error(result, "--batch-sizes 100000", "at b=100000", "GiB are free on cpu", "at most ")
    assert not (tmp_path / "b" / "bench.json").exists()
