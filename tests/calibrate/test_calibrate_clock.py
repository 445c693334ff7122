"""The device clock's marks (runtime.clock) and the step recorder that reads them (calibrate.pass_clock).

On the CPU a mark is perf_counter, so a region's figure is what two perf_counter readings around it give
(checked against sleeping workloads bracketed by perf_counter). On CUDA a timed region records two events
on the stream and nothing else: torch's own GPU trace (the hooks its CUDA sanitizer uses) sees every
event record and every synchronization, and the tests assert that none happens inside a region."""
from __future__ import annotations

import time

import pytest
import torch

from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.calibrate.timing import device_timed_ms
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.generator import SpeculativeGenerator, StepRecord
from specbatch.runtime.policy import FixedK

SLEEP_S = 0.004


class SleepingModel:
    """A 'forward pass' that sleeps: its time is known to lie between the sleep and the perf_counter bracket."""

    def __init__(self):
        self.brackets: list[float] = []

    def __call__(self, tokens, cache, attention=None, last=None):
        started = time.perf_counter()
        time.sleep(SLEEP_S)
        self.brackets.append(time.perf_counter() - started)
        return tokens


class HostLengthsCache:
    def __init__(self, lengths: list[int], device="cpu"):
        self.host_lengths = list(lengths)
        self.lengths = torch.tensor(lengths, device=device)

    def longest(self) -> int:
        return max(self.host_lengths)


def test_a_cpu_mark_is_perf_counter_and_a_region_is_their_difference():
    clock = DeviceClock("cpu")
    assert not clock.uses_events
    before = time.perf_counter()
    start = clock.mark()
    time.sleep(SLEEP_S)
    end = clock.mark()
    after = time.perf_counter()
    assert before <= start <= end <= after
    assert SLEEP_S <= clock.elapsed_s(start, end) == end - start <= after - before
    assert before <= clock.host_s() and before <= clock()  # budgets read the host clock


def test_device_timed_ms_on_the_cpu_lies_within_a_perf_counter_bracket():
    before = time.perf_counter()
    ms = device_timed_ms(lambda: time.sleep(SLEEP_S), DeviceClock("cpu"))
    assert 1000 * SLEEP_S <= ms <= 1000 * (time.perf_counter() - before)


def test_the_recorder_on_the_cpu_gives_each_pass_and_step_its_perf_counter_time():
    recorder, model = StepRecorder("cpu"), SleepingModel()
    cache = HostLengthsCache([5, 9])
    before = time.perf_counter()
    recorder.step_started()
    for role, width in (("draft", 2), ("draft", 1), ("target", 3)):
        recorder.run_pass(role, model, torch.zeros(2, width, dtype=torch.long), cache)
    time.sleep(SLEEP_S)  # the step's own work outside its passes
    recorder.step_finished(StepRecord(2, 10, 2, 2, 2, 6, 6, 0.0))
    step_bracket = time.perf_counter() - before
    passes = recorder.passes["draft"] + recorder.passes["target"]
    assert [(b, n, context) for b, n, context, _ in passes] == [(2, 2, 9), (2, 1, 9), (2, 3, 9)]
    for (*_, seconds), inner in zip(passes, model.brackets):
        assert SLEEP_S <= inner <= seconds  # the mark pair encloses the pass's own bracket
    assert sum(seconds for *_, seconds in passes) + SLEEP_S <= recorder.step_s[0] <= step_bracket
    assert recorder.overhead_s() == pytest.approx(recorder.step_s[0] - sum(s for *_, s in passes))
    assert recorder.overhead_s() >= SLEEP_S


def test_a_generation_records_the_same_passes_as_before(greedy_target, greedy_draft_sometimes, prompts8):
    """Every step pass of a real generation is recorded once, with the step's batch and width."""
    recorder = StepRecorder("cpu")
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts8[:3], 10, FixedK(3),
                                                                                  observer=recorder)
    assert len(recorder.steps) == result.stats.steps == len(recorder.passes["target"])
    assert [n for _, n, _, _ in recorder.passes["target"]] == [4] * result.stats.steps
    assert all(seconds > 0 for rows in recorder.passes.values() for *_, seconds in rows)
    assert all(step >= 0 for step in recorder.step_s) and recorder.overhead_s() > 0


# ---------------------------------------------------------------- CUDA
class GpuTrace:
    """Every CUDA event record and synchronization torch reports, in order (torch.cuda._gpu_trace)."""

    def __init__(self):
        from torch.cuda import _gpu_trace

        self.log: list[str] = []
        self.active = False
        torch._C._activate_gpu_trace()
        hooks = {"record": _gpu_trace.register_callback_for_event_record,
                 "device sync": _gpu_trace.register_callback_for_device_synchronization,
                 "stream sync": _gpu_trace.register_callback_for_stream_synchronization,
                 "event sync": _gpu_trace.register_callback_for_event_synchronization}
        for kind, register in hooks.items():
            register(lambda *args, kind=kind: self.active and self.log.append(kind))

    def during(self, call):
        self.log, self.active = [], True
        try:
            call()
        finally:
            self.active = False
        return list(self.log)


@pytest.fixture(scope="module")
def gpu_trace():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return GpuTrace()


def _matmuls(tokens, cache, attention=None, last=None):
    x = torch.randn(512, 512, device="cuda")
    for _ in range(8):
        x = x @ x / 32.0
    return x


@pytest.mark.gpu
def test_on_cuda_a_timed_region_records_two_events_and_synchronizes_nothing(gpu_trace):
    recorder = StepRecorder("cuda")
    cache = HostLengthsCache([5, 9], "cuda")
    tokens = torch.zeros(2, 3, dtype=torch.long, device="cuda")
    recorder.step_started()
    inside = gpu_trace.during(lambda: [recorder.run_pass("target", _matmuls, tokens, cache) for _ in range(3)])
    assert inside == ["record"] * 6  # a start and an end event per pass, no synchronization of any kind
    torch.zeros(1, device="cuda").tolist()  # the runtime's own end-of-step readback
    after = gpu_trace.during(lambda: recorder.step_finished(StepRecord(2, 10, 2, 2, 2, 6, 6, 0.0)))
    assert "stream sync" not in after and "device sync" not in after  # reading back waits on events only
    assert all(seconds > 0 for *_, seconds in recorder.passes["target"])
    clock = DeviceClock("cuda")
    assert gpu_trace.during(lambda: clock.mark()) == ["record"]


@pytest.mark.gpu
def test_on_cuda_the_recorder_adds_no_synchronization_to_a_generation(gpu_trace):
    """The same greedy generation with and without a recorder: the same stream and device syncs (the
    runtime's own: the recorder reads each pass's context from the cache's host lengths)."""
    from specbatch.runtime.checkpoint import build_model
    from specbatch.runtime.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=256)
    target, draft = build_model(config, "cuda", seed=1), build_model(config, "cuda", seed=2)
    generator = SpeculativeGenerator(target, draft, eos_token_ids=())
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    def syncs(observer):
        log = gpu_trace.during(lambda: generator.generate(prompts, 12, FixedK(3), observer=observer))
        return sum(kind in ("stream sync", "device sync") for kind in log)

    syncs(None)  # warm-up: first calls allocate and pick kernels
    plain = syncs(None)
    quiet = StepRecorder("cuda", pass_contexts=False)
    assert syncs(quiet) == plain
    assert syncs(StepRecorder("cuda")) == plain
