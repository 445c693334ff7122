"""`calibrate --engine vllm` without vLLM: which configurations a grid becomes, the prompts they share, and how a
worker's answer (vllm_worker.py's "steps": per-step records and vLLM's spec-decode counters, constructed here
as vLLM writes them) becomes a profile row. tests/bench/test_bench_vllm_calibrate.py runs vLLM itself."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.vllm_steps import (EngineCalibrationRequest, EnginePoint, _check, new_tokens_for,
                                            plan_points, step_row, window_prompts)
from specbatch.perfmodel.errors import PerfModelError


def test_every_configuration_once_per_sweep_k_reversed_every_other_sweep():
    points = plan_points([8, 1, 8], [512, 128], 3, 3)
    assert len(points) == 3 * 2 * 2 * (3 + 2)  # sweeps x prompt lengths x batch sizes x (none, K = 0..3)
    assert Counter(p.key()[:-1] for p in points) == Counter({key: 3 for key in {p.key()[:-1] for p in points}})
    assert [p.sweep for p in points] == sorted(p.sweep for p in points)  # sweep after sweep
    first = [(p.mode, p.k) for p in points[:5]]
    assert first == [("none", 0), ("schedule", 0), ("schedule", 1), ("schedule", 2), ("schedule", 3)]
    second = [(p.mode, p.k) for p in points if p.sweep == 2][:5]
    assert second == first[::-1]
    assert [(p.prompt_len, p.batch_size) for p in points[:20:5]] == [(128, 1), (128, 8), (512, 1), (512, 8)]


def test_prompts_are_shared_by_the_ks_of_a_sweep_and_change_between_sweeps():
    stream = list(range(1000))
    one = window_prompts(stream, 4, 64, 1)
    assert one == window_prompts(stream, 4, 64, 1) and len(one) == 4
    assert all(len(p) == 64 and p == list(range(p[0], p[0] + 64)) for p in one)  # contiguous text
    assert window_prompts(stream, 4, 64, 2) != one
    with pytest.raises(CalibrationError, match="too few to cut prompts of 1000"):
        window_prompts(stream, 1, 1000, 1)


def request(**changes) -> EngineCalibrationRequest:
    values = dict(target="t", draft="d", out=Path("/tmp/nowhere/p.json"), prompts=Path("p.jsonl"), batch_sizes=(1, 8),
                  context_lens=(128, 512), max_k=8)
    return EngineCalibrationRequest(**{**values, **changes})


def test_a_prompt_and_its_generation_must_fit_vllm_s_max_model_len(tmp_path):
    fits = request(out=tmp_path / "p.json")
    assert new_tokens_for(fits) == 8 * 9 + 1
    _check(fits)
    with pytest.raises(CalibrationError, match="exceed vLLM's max_model_len 1024"):
        _check(request(out=tmp_path / "p.json", context_lens=(1000,)))
    (tmp_path / "p.json").write_text('{"schema": "specbatch.profile/1"}')
    with pytest.raises(PerfModelError, match="pass --force to replace it, --resume to continue it"):
        _check(fits)
    (tmp_path / "p.json").write_text("{}")  # not a profile: never replaced, --force or not
    with pytest.raises(PerfModelError, match="never replaced"):
        _check(request(out=tmp_path / "p.json", force=True))


def steps(b: int, k: int, times_ms: list[float], contexts: list[float]) -> list[dict]:
    """A run as the worker records it: one prefill step, then decode steps of b requests scheduling 1 + k tokens."""
    prefill = {"wall_s": 0.5, "requests": b, "new_requests": b, "prefill": True, "tokens": 100 * b, "k": k,
               "context": 0.0}
    return [prefill] + [{"wall_s": ms / 1e3, "requests": b, "new_requests": 0, "prefill": False, "tokens": b * (k + 1),
                         "k": k, "context": c} for ms, c in zip(times_ms, contexts)]


def answer(b: int, k: int, times_ms, contexts, drafts=0, accepted=0, per_position=(), max_k=8) -> dict:
    return {"token_ids": [None] * b, "wall_s": 1.0, "steps": steps(b, k, times_ms, contexts), "k_per_step": [],
            "metrics": {"drafts": drafts, "draft_tokens": drafts * k, "accepted_tokens": accepted,
                        "accepted_per_position": list(per_position) + [0] * (max_k - len(per_position))}}


def test_a_worker_answer_becomes_a_row_of_decode_steps_over_the_full_batch():
    times = [10.0, 12.0, 11.0, 30.0, 9.0]
    run = answer(4, 3, times, [130, 132, 135, 137, 140], drafts=20, accepted=26, per_position=[12, 9, 5])
    run["steps"].append({"wall_s": 0.001, "requests": 3, "new_requests": 0, "prefill": False, "tokens": 12, "k": 3,
                         "context": 150})  # a row gone: not over the full batch, left out
    row = step_row(EnginePoint("schedule", 4, 3, 128, 2), run)
    assert (row.mode, row.batch_size, row.k, row.prompt_len, row.sweep, row.reps) == ("schedule", 4, 3, 128, 2, 5)
    assert row.median_ms == pytest.approx(11.0) and row.context_len == 135
    assert (row.p10_ms, row.p90_ms) == pytest.approx(tuple(np.percentile(times, [10, 90])))
    assert row.tokens_per_step == pytest.approx(1 + 26 / 20)
    assert (row.drafts, row.draft_tokens, row.accepted_tokens) == (20, 60, 26)
    assert row.accepted_per_position == (12, 9, 5)  # vLLM's vector has num_speculative_tokens entries


def test_the_engine_without_speculation_drafts_nothing():
    row = step_row(EnginePoint("none", 2, 0, 64, 1), answer(2, 0, [5.0, 6.0], [70, 71]))
    assert row.tokens_per_step == 1.0 and row.drafts == 0 and row.accepted_per_position == ()


@pytest.mark.parametrize("run, message", [
    (answer(4, 2, [10.0], [130]), "scheduler chose K = \\[2\\], not 3"),
    (answer(4, 3, [10.0], [130], drafts=4, accepted=4, per_position=[2, 1, 1, 1]), "accepted tokens beyond position 3"),
    ({**answer(4, 3, [], []), "steps": steps(4, 3, [], [])}, "no decode step over the full batch"),
])
def test_an_answer_that_is_not_the_configuration_asked_for_is_refused(run, message):
    with pytest.raises(CalibrationError, match=message):
        step_row(EnginePoint("schedule", 4, 3, 128, 1), run)
