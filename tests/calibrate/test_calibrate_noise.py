"""The noise monitor on an injectable clock and a scripted reference pass: when it checks, the drift and
jitter it reports (hand-computed), the one-line warning, and the profile field (older profiles load)."""
import json

import pytest

from specbatch.calibrate.noise import NoiseMonitor
from specbatch.perfmodel.profile.noise import NoiseCheck, NoiseFigure, noise_from_json
from specbatch.perfmodel.profile import profile_from_json
from perfmodel_fixtures import build_profile, roofline_latency


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scripted(values):
    it = iter(values)
    return lambda: next(it)


def test_checks_happen_at_the_start_then_once_per_interval():
    clock = FakeClock()
    # each check: 1 warm-up + 3 samples
    monitor = NoiseMonitor(scripted([99, 10, 10, 10] + [99, 11, 11, 11] + [99, 12, 12, 12]), "ref", clock,
                           interval_s=5.0, samples=3)
    monitor.check(force=True)  # at the start
    clock.now = 103.0
    monitor.check()  # 3 s later: not due
    clock.now = 105.5
    monitor.check()  # 5.5 s after the first: due
    clock.now = 106.0
    monitor.check(force=True)  # at the end, due or not
    figure = monitor.figure()
    assert [c.elapsed_s for c in figure.checks] == [0.0, 5.5, 6.0]
    assert [c.median_ms for c in figure.checks] == [10, 11, 12]
    # drift: (12 - 10) / 2 / median 11 = 9.1 %; jitter 0 (every sample of a check equal)
    assert figure.drift == pytest.approx(1 / 11) and figure.jitter == 0.0
    # floor: mean |10, 11, 12 - 11| / 11 = (1 + 0 + 1) / 3 / 11
    assert figure.floor_mape == pytest.approx(2 / 3 / 11)
    assert figure.too_noisy
    warning = figure.warning()
    assert warning.startswith("warning: noisy machine: the reference pass (ref) drifted ±9.1 % over 3 checks")
    assert "\n" not in warning


def test_a_quiet_machine_gives_no_warning_and_jitter_is_the_median_half_p10_p90():
    figure = NoiseFigure("ref", (NoiseCheck(0.0, 10.0, 9.8, 10.2), NoiseCheck(3.0, 10.1, 9.9, 10.5),
                                 NoiseCheck(6.0, 10.0, 9.0, 11.0)))
    assert figure.drift == pytest.approx(0.05 / 10.0)
    assert figure.jitter == pytest.approx(0.3 / 10.1)  # half-spreads 2 %, 2.97 %, 10 %: the median
    assert figure.warning() is None and not figure.too_noisy


def test_the_profile_records_the_noise_and_older_profiles_load_unchanged():
    obj = build_profile(roofline_latency(), batch_sizes=(1, 2), context_lens=(128,), max_k=2)
    assert "noise" not in obj
    old = profile_from_json(obj)
    assert old.noise is None and "noise" not in old.to_json()
    figure = NoiseFigure("target b=1 n=1 L=128", (NoiseCheck(0.0, 2.0, 1.9, 2.1), NoiseCheck(4.0, 2.4, 2.3, 2.5)))
    again = profile_from_json(json.loads(json.dumps({**obj, "noise": figure.to_json()})))
    assert again.noise == figure and again.to_json()["noise"]["too_noisy"] is True
    with pytest.raises(Exception, match="noise"):
        noise_from_json({"reference": "x", "checks": []}, "profile.json: noise")


def test_the_model_file_keeps_the_calibrations_reference_pass():
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import model_from_json, model_to_json

    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=2)
    figure = NoiseFigure("target b=2 n=1 L=128", (NoiseCheck(0.0, 2.0, 1.9, 2.1), NoiseCheck(4.0, 2.4, 2.3, 2.5)))
    fitted = fit_profile(profile_from_json({**obj, "noise": figure.to_json()}))
    again = model_from_json(json.loads(json.dumps(model_to_json(fitted))))
    assert again.noise == figure and again.noise.reference_shape() == (2, 128)
    assert model_from_json(json.loads(json.dumps(model_to_json(fit_profile(profile_from_json(obj)))))).noise is None
    with pytest.raises(Exception, match="expected 'target b=B n=1 L=L'"):
        NoiseFigure("draft b=1", figure.checks).reference_shape()
