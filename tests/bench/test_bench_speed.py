"""The machine's speed against calibration's (bench.speed) on scripted reference-pass checks: the
slowdown per batch size, hand-computed."""
import pytest

from specbatch.bench.results import BatchResult
from specbatch.bench.speed import MachineSpeed, add_machine_speed
from specbatch.calibrate.noise import NoiseMonitor
from specbatch.perfmodel.profile.noise import NoiseCheck, NoiseFigure


def scripted(values):
    it = iter(values)
    return lambda: next(it)


def test_bench_reports_the_reference_pass_slowdown_per_batch_size():
    calibration = NoiseFigure("target b=1 n=1 L=64", (NoiseCheck(0.0, 4.0, 4.0, 4.0), NoiseCheck(3.0, 6.0, 6.0, 6.0),
                                                       NoiseCheck(6.0, 5.0, 5.0, 5.0)))  # level: 5 ms
    # each check: 1 warm-up + 3 samples; b = 1 sees 6, 7.5 and 9 ms (median 7.5), b = 8 sees 4 and 5 ms
    values = [0, 6, 6, 6, 0, 7.5, 7.5, 7.5, 0, 9, 9, 9, 0, 4, 4, 4, 0, 5, 5, 5]
    speed = MachineSpeed(None, calibration, "cpu", NoiseMonitor(scripted(values), calibration.reference,
                                                                lambda: 0.0, samples=3))
    for b in (1, 1, 1, 8, 8):
        speed.check(b)
    assert speed.slowdown(1) == pytest.approx(1.5) and speed.slowdown(8) == pytest.approx(0.9)
    assert speed.slowdown(2) is None and speed.at(2) is None
    assert speed.at(1)["checks"] == 3 and speed.at(1)["bench_ms"] == 7.5 and speed.at(1)["calibration_ms"] == 5.0
    batches = [BatchResult(b, 64, [], 0, 1.0, None, None, None) for b in (1, 8, 2)]
    add_machine_speed(batches, speed)
    assert [b.machine_speed and b.machine_speed["slowdown"] for b in batches] == [pytest.approx(1.5),
                                                                                  pytest.approx(0.9), None]


@pytest.mark.parametrize("graphs", [False, True])
def test_the_reference_pass_runs_as_calibration_timed_it(graphs, greedy_target, monkeypatch):
    """A bench that runs graphed times the reference pass graphed, as a graphed calibration did (an eager
    reference against a graphed one would call the machine slow); an eager bench, eager."""
    from specbatch.bench import speed as speed_module
    from specbatch.runtime.cuda_graphs import GraphedModel

    seen = []

    def recording_sampler(model, batch_size, context_len, device, clock):
        seen.append(model)
        return lambda: 1.0

    monkeypatch.setattr(speed_module, "reference_sampler", recording_sampler)
    calibration = NoiseFigure("target b=1 n=1 L=64", (NoiseCheck(0.0, 4.0, 4.0, 4.0),))
    speed_module.machine_speed_for(greedy_target, calibration, "cpu", "model.json", graphs=graphs)
    assert len(seen) == 1 and isinstance(seen[0], GraphedModel) == graphs
    assert (seen[0].model if graphs else seen[0]) is greedy_target
