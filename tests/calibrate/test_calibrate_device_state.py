"""The GPU's state in the profile: NVML readings (calibrate.environment.NvmlReader) against a constructed
NVML whose functions return scripted values (a fake only at the NVML boundary: the `pynvml` module's
functions and constants, with their units: power in milliwatts, clocks in MHz, reasons as a bitmask), the
full-load warm-up on a fake clock, the second drift reference, the warning when clocks fell, and the
profile's optional fields (older profiles load unchanged)."""
from __future__ import annotations

import json

import pytest

from specbatch.calibrate.environment import NvmlReader, open_nvml
from specbatch.calibrate.noise import WARMUP_MIN_S, MachineWatch, NoiseMonitor, warm_up
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile import load_profile, profile_from_json, save_profile
from specbatch.perfmodel.profile.device_state import DeviceReading, DeviceState
from perfmodel_fixtures import build_profile, roofline_latency


class FakeNvml:
    """The part of `pynvml` the reader calls, returning scripted values (SM clocks one per reading)."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    class NVMLError(Exception):
        pass

    def __init__(self, sm_clocks_mhz, power_mw=450_000, temperature_c=61, reasons=0x4 | 0x40, refuse=(),
                 reasons_api="nvmlDeviceGetCurrentClocksEventReasons"):
        """`reasons_api`: the name the driver's bindings give the reasons query (older ones: ...Throttle...)."""
        self.sm_clocks, self.power_mw, self.temperature_c = list(sm_clocks_mhz), power_mw, temperature_c
        self.refuse, self.calls = set(refuse), []
        setattr(self, reasons_api, lambda handle: self._call(reasons_api, reasons))

    def _call(self, name, value):
        self.calls.append(name)
        if name in self.refuse:
            raise self.NVMLError(f"{name}: not supported")
        return value

    def nvmlInit(self):
        self.calls.append("nvmlInit")

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return self._call("clock", self.sm_clocks.pop(0) if kind == self.NVML_CLOCK_SM else 2619)

    def nvmlDeviceGetMaxClockInfo(self, handle, kind):
        return self._call("max clock", 1980)

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._call("power", self.power_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return self._call("power limit", 700_000)

    def nvmlDeviceGetTemperature(self, handle, sensor):
        return self._call("temperature", self.temperature_c)


class FakeClock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_reading_converts_nvml_units_and_names_the_clock_event_reasons():
    nvml = FakeNvml([1980])
    reader = NvmlReader(nvml, 0)
    reading = reader.reading(12.3456)
    assert reading == DeviceReading(12.346, 1980, 2619, 450.0, 61, ("sw_power_cap", "hw_thermal_slowdown"))
    assert (reader.max_sm_clock_mhz(), reader.power_limit_w()) == (1980, 700.0)
    reader.close()
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"


def test_a_refused_field_gives_no_reading_and_older_drivers_name_reasons_the_old_way():
    assert NvmlReader(FakeNvml([1980], refuse={"power"}), 0).reading(1.0) is None
    old = FakeNvml([1700], reasons=0x8, reasons_api="nvmlDeviceGetCurrentClocksThrottleReasons")
    assert NvmlReader(old, 0).reading(1.0).throttle_reasons == ("hw_slowdown",)


def test_no_nvml_on_a_cpu():
    assert open_nvml("cpu") is None


def test_the_warm_up_runs_until_the_pass_time_settles_or_its_limit():
    clock = FakeClock()
    times = iter([10.0] * 1000)

    def sample_ms():
        value = next(times)
        clock.now_s += value / 1000
        return value

    # a steady pass: settled after the second window, but never before WARMUP_MIN_S
    assert WARMUP_MIN_S <= warm_up(sample_ms, clock) < WARMUP_MIN_S + 1.1
    clock.now_s, slowing = 0.0, iter(10.0 * 1.05 ** i for i in range(100000))  # 5 % slower each sample: never settles

    def throttling_ms():
        value = next(slowing)
        clock.now_s += 0.25
        return value

    assert warm_up(throttling_ms, clock, min_s=1.0, max_s=4.0, window_s=1.0) == pytest.approx(4.0)


def _scripted(values):
    it = iter(values)
    return lambda: next(it)


def test_the_watch_warms_up_on_the_large_reference_and_records_both_figures_and_the_clocks():
    clock = FakeClock()
    large_samples = []

    def large_ms():
        clock.now_s += 0.5
        large_samples.append(clock.now_s)
        return 40.0

    small = NoiseMonitor(_scripted([1.0] * 100), "target b=1 n=1 L=16", clock, samples=3)
    large = NoiseMonitor(large_ms, "target b=64 n=1 L=16", clock, samples=3)
    watch = MachineWatch(small, large, NvmlReader(FakeNvml([1980, 1800]), 0), on_cuda=True)
    watch.start(clock)
    warmed = len(large_samples) - 4  # the start check: one warm-up sample and three
    assert warmed >= WARMUP_MIN_S / 0.5 and watch.warmup_s >= WARMUP_MIN_S
    noise, noise_large, state = watch.finish(clock)
    assert noise.reference == "target b=1 n=1 L=16" and noise_large.reference == "target b=64 n=1 L=16"
    assert len(noise.checks) == len(noise_large.checks) == 2
    assert (state.start.sm_clock_mhz, state.end.sm_clock_mhz, state.max_sm_clock_mhz) == (1980, 1800, 1980)
    assert state.clock_drop == pytest.approx(1 - 1800 / 1980)
    assert "SM clock fell from 1980 to 1800 MHz (-9 %)" in state.warning() and "sw_power_cap" in state.warning()


def test_on_a_cpu_the_watch_neither_warms_up_nor_records_a_device_state():
    clock = FakeClock()
    watch = MachineWatch(NoiseMonitor(_scripted([1.0] * 100), "target b=1 n=1 L=16", clock, samples=3), None)
    watch.start(clock)
    noise, noise_large, state = watch.finish(clock)
    assert watch.warmup_s == 0.0 and noise_large is None and state is None and len(noise.checks) == 2


def test_a_steady_clock_gives_no_warning_and_no_nvml_still_records_the_warm_up():
    steady = DeviceState(12.0, 1980, 700.0, DeviceReading(1.0, 1980, 2619, 500.0, 60),
                         DeviceReading(90.0, 1965, 2619, 520.0, 66))
    assert steady.warning() is None
    unread = DeviceState(12.0, None, None, None, None)
    assert unread.clock_drop is None and unread.warning() is None


def test_the_profile_keeps_the_state_and_older_profiles_load_without_it(tmp_path):
    obj = build_profile(roofline_latency(), batch_sizes=(1, 4), context_lens=(128,), max_k=2, acceptance=[0.8, 0.7])
    old = tmp_path / "old.json"
    old.write_text(json.dumps(obj))
    profile = load_profile(old)
    assert profile.device_state is None and profile.noise_large_batch is None and profile.warnings() == ()
    state = DeviceState(14.5, 1980, 700.0, DeviceReading(2.0, 1980, 2619, 610.5, 58, ("sw_power_cap",)),
                        DeviceReading(300.0, 1755, 2619, 699.0, 79, ("sw_power_cap",)))
    from dataclasses import replace

    new = replace(profile, device_state=state)
    path = tmp_path / "new.json"
    save_profile(path, new)
    again = load_profile(path)
    assert again.device_state == state and again == new
    assert again.warnings() == (state.warning(),)
    broken = json.loads(path.read_text())
    broken["device_state"]["end"]["power_w"] = "hot"
    with pytest.raises(PerfModelError, match=r"^p.json: device_state.end.power_w: expected a number, found 'hot'$"):
        profile_from_json(broken, "p.json")
