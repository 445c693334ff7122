"""The in-situ step correction (perfmodel.steps): constructed lockstep steps whose ratios and machine speeds
are known, so the factors, the shrinkage and the held-out verdict are computed by hand below."""
import dataclasses
import math
from dataclasses import dataclass

import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.explain import CORRECTION, MeasuredSteps, PassTally, explain
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.steps import StepCorrection, fit_step_correction, paired_error_pct
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, parse_tree


@dataclass(frozen=True)
class Step:  # the fields of perfmodel.profile.insitu.InSituStepRow the correction reads
    batch_size: int
    k: int
    sweep: int | None
    median_ms: float
    context_len: int = 100


PREDICTED_MS = {0: 10.0, 2: 20.0, 4: 30.0}
TRUE_RATIO = {0: 1.0, 2: 1.1, 4: 0.95}  # the runtime's step over the model's, at every sweep
SPEED = {1: 1.0, 2: 2.0, 3: 0.7}  # the machine's speed in each sweep: common to the ks of a sweep


def lockstep(batch_size=4, noise=None):
    noise = noise or {}
    return [Step(batch_size, k, s, PREDICTED_MS[k] * TRUE_RATIO[k] * SPEED[s] * noise.get((k, s), 1.0))
            for s in SPEED for k in PREDICTED_MS]


def predicted(rows, ratio=lambda row: 1.0):
    """The model's time of each row, aligned with them."""
    return [PREDICTED_MS[row.k] * ratio(row) for row in rows]


def test_ratios_are_recovered_and_the_machine_speed_cancels():
    correction = fit_step_correction(lockstep(), predicted(lockstep()))
    mean_log = sum(math.log(r) for r in TRUE_RATIO.values()) / 3
    for k, ratio in TRUE_RATIO.items():  # no spread between sweeps: nothing to shrink
        assert correction.log_factors[(4, k)] == pytest.approx(math.log(ratio) - mean_log)
        assert correction.factor(4, k) == pytest.approx(ratio / math.exp(mean_log))
    assert correction.sweeps == 3
    assert correction.heldout_error_pct == pytest.approx(0.0, abs=1e-9)
    # held out, the model alone misses each paired ratio by |log ratio - mean|, averaged over the ks
    assert correction.heldout_uncorrected_pct == pytest.approx(
        100 * sum(abs(math.log(r) - mean_log) for r in TRUE_RATIO.values()) / 3)
    assert correction.applied


def test_paired_error_of_a_model_on_lockstep_steps():
    mean_log = sum(math.log(r) for r in TRUE_RATIO.values()) / 3
    by_hand = 100 * sum(abs(math.log(r) - mean_log) for r in TRUE_RATIO.values()) / 3
    assert paired_error_pct(lockstep(), predicted(lockstep())) == pytest.approx(by_hand)
    # a model that knows the ratios (whatever its level) has none; rows without a sweep have nothing to pair
    knows = predicted(lockstep(), lambda row: 3.0 * TRUE_RATIO[row.k])
    assert paired_error_pct(lockstep(), knows) == pytest.approx(0.0)
    unswept = [Step(4, 2, None, 1.0), Step(4, 0, None, 2.0)]
    assert paired_error_pct(unswept, predicted(unswept)) is None


def test_a_factor_within_its_own_spread_is_shrunk_to_nothing():
    # k = 4's paired residual swings by +-10 % between sweeps around a mean of +-0 : shrunk to exactly 0
    swing = {(4, 1): 1.10, (4, 2): 0.90, (4, 3): 1.0}
    correction = fit_step_correction(lockstep(noise=swing), predicted(lockstep(noise=swing)))
    d = {}
    for s in SPEED:
        logs = {k: math.log(TRUE_RATIO[k] * swing.get((k, s), 1.0)) for k in PREDICTED_MS}
        mean = sum(logs.values()) / 3
        d.update({(k, s): v - mean for k, v in logs.items()})
    for k in PREDICTED_MS:
        values = [d[(k, s)] for s in SPEED]
        mean = sum(values) / 3
        se2 = sum((v - mean) ** 2 for v in values) / 2 / 3
        expected = mean * max(0.0, 1 - se2 / mean ** 2)
        assert correction.log_factors[(4, k)] == pytest.approx(expected)
    assert abs(correction.log_factors[(4, 4)]) < abs(sum(d[(4, s)] for s in SPEED) / 3)


def test_nothing_to_validate_or_pair_gives_no_correction():
    two_sweeps = [row for row in lockstep() if row.sweep != 3]
    assert fit_step_correction(two_sweeps, predicted(two_sweeps)) is None
    unswept = [Step(r.batch_size, r.k, None, r.median_ms) for r in lockstep()]
    assert fit_step_correction(unswept, predicted(unswept)) is None
    one_k = [row for row in lockstep() if row.k == 2]
    assert fit_step_correction(one_k, predicted(one_k)) is None


def test_a_correction_that_does_not_predict_held_out_sweeps_is_not_applied():
    # each sweep's ratios are reversed from the last: learned on two, the third is missed by more
    flips = {(2, 1): 1.2, (2, 2): 1 / 1.2, (2, 3): 1.2, (4, 1): 1 / 1.2, (4, 2): 1.2, (4, 3): 1 / 1.2}
    rows = [Step(4, k, s, PREDICTED_MS[k] * SPEED[s] * flips.get((k, s), 1.0)) for s in SPEED for k in PREDICTED_MS]
    correction = fit_step_correction(rows, predicted(rows))
    assert correction.heldout_error_pct >= correction.heldout_uncorrected_pct
    assert not correction.applied and correction.factor(4, 2) == 1.0
    assert "not applied" in correction.note()


def test_interpolation_between_measured_points_and_the_edge_held_beyond():
    correction = StepCorrection({(2, 0): 0.0, (2, 4): 0.2, (8, 0): 0.1, (8, 4): -0.1}, 3, 1.0, 2.0)
    assert correction.factor(2, 2) == pytest.approx(math.exp(0.1))  # halfway in k
    assert correction.factor(2, 8) == pytest.approx(math.exp(0.2))  # held beyond the largest measured k
    assert correction.factor(4, 0) == pytest.approx(math.exp(0.05))  # halfway in log b
    assert correction.factor(4, 4) == pytest.approx(math.exp(0.05))
    assert correction.factor(1, 4) == pytest.approx(math.exp(0.2))  # below the measured b: the smallest's
    assert correction.factor(64, 4) == pytest.approx(math.exp(-0.1))  # beyond: the largest's, as the latency


def test_json_round_trip_and_malformed_input():
    correction = fit_step_correction(lockstep(), predicted(lockstep()))
    again = StepCorrection.from_json(correction.to_json(), "m.json: step_correction")
    assert again.factor(4, 2) == pytest.approx(correction.factor(4, 2), rel=1e-6) and again.applied
    with pytest.raises(PerfModelError, match=r"^m.json: step_correction.factors: missing$"):
        StepCorrection.from_json({"sweeps": 3}, "m.json: step_correction")
    with pytest.raises(PerfModelError, match="finite factors"):
        StepCorrection.from_json(dict(correction.to_json(), factors=[]), "m.json: step_correction")


def latency_ms(role, b, n, L):
    return 1.0 + n if role == "draft" else 10.0 + 2 * n


CORRECTED = StepCorrection({(2, 0): 0.0, (2, 2): math.log(1.2), (2, 4): 0.0}, 3, 1.0, 2.0)


def test_the_step_model_scales_every_strategy_at_its_verified_width():
    acceptance = dataclasses.replace(acceptance_from_user([0.5, 0.5, 0.5, 0.5]), rank_acceptance=((0.5, 0.2),) * 2)
    plain = StepModel(latency_ms, OverheadModel(()), acceptance)
    corrected = StepModel(latency_ms, OverheadModel(()), acceptance, step_correction=CORRECTED)
    base, chain = plain.evaluate(Strategy.from_k(2), 2, 64), corrected.evaluate(Strategy.from_k(2), 2, 64)
    assert chain.step_ms == pytest.approx(1.2 * base.step_ms)
    assert chain.correction_ms == pytest.approx(0.2 * base.step_ms)
    assert chain.tokens_per_s == pytest.approx(base.tokens_per_s / 1.2)
    tree = Strategy(parse_tree("0,1,0.0"))  # 3 nodes: halfway between k = 2 (x1.2) and k = 4 (x1) in log
    assert tree.draft_tokens == 3 and tree.k == 2
    assert corrected.evaluate(tree, 2, 64).step_ms == pytest.approx(1.2 ** 0.5 * plain.evaluate(tree, 2, 64).step_ms)
    wide = Strategy(parse_tree("0,1,2,0.0,0.1,1.0"))  # 6 nodes: beyond the widest measured k, its factor held
    assert corrected.evaluate(wide, 2, 64).step_ms == pytest.approx(plain.evaluate(wide, 2, 64).step_ms)
    none = Strategy.from_k(0)
    assert corrected.evaluate(none, 2, 64).step_ms == pytest.approx(plain.evaluate(none, 2, 64).step_ms)
    beyond = corrected.evaluate(Strategy.from_k(2), 64, 64)  # beyond the measured b: the edge's factor
    assert beyond.step_ms == pytest.approx(1.2 * plain.evaluate(Strategy.from_k(2), 64, 64).step_ms)


def test_the_decomposition_names_the_correction_and_still_sums():
    model = StepModel(latency_ms, OverheadModel(()), acceptance_from_user([0.5]), step_correction=CORRECTED)
    measured = MeasuredSteps(batch_size=2, steps=4, step_seconds=0.100, tokens=14,
                             passes=(PassTally("draft", 1, 6, 0.012), PassTally("draft", 2, 2, 0.006),
                                     PassTally("target", 3, 4, 0.064)))
    result = explain(model, Strategy.from_k(2), measured, context_len=64)
    terms = {t.name: t for t in result.terms}
    predicted = model.evaluate(Strategy.from_k(2), 2, 64)
    assert terms[CORRECTION].predicted_ms == pytest.approx(predicted.correction_ms)
    assert terms[CORRECTION].measured_ms == 0.0
    assert sum(t.predicted_ms for t in result.terms) == pytest.approx(result.predicted_step_ms)
    assert sum(t.measured_ms for t in result.terms) == pytest.approx(result.measured_step_ms)
    assert dict(result.effects())[CORRECTION] == pytest.approx(-predicted.correction_ms / 25.0)


def test_fit_learns_the_correction_from_a_profile_and_keeps_it_in_the_model_file(tmp_path):
    """Lockstep steps in three sweeps at machine speeds 1, 2 and 0.7, chain k = 2 20 % slower than its passes
    in every sweep (the others exact): k = 2 ends 1.2^(3/4) x the model and the others 1.2^(-1/4), at every b."""
    import json

    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import load_model, save_model
    from specbatch.perfmodel.profile import load_profile
    from test_perfmodel_insitu import INSITU_BATCH_SIZES, INSITU_KS, constructed

    obj = constructed(1.0, 1.0)
    one_sweep = obj["insitu_steps"]
    obj["insitu_steps"] = [dict(row, sweep=s, median_ms=row["median_ms"] * speed * (1.2 if row["k"] == 2 else 1.0),
                                p90_ms=row["p90_ms"] * speed * 1.2)
                           for s, speed in SPEED.items() for row in one_sweep]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(obj))
    fitted = fit_profile(load_profile(path))
    correction = fitted.step_correction
    assert correction.applied and correction.sweeps == 3
    for b in INSITU_BATCH_SIZES:
        for k in INSITU_KS:
            assert correction.factor(b, k) == pytest.approx(1.2 ** (0.75 if k == 2 else -0.25), rel=1e-3)
    assert fitted.timing_source_notes()[-1].startswith("in-situ step correction applied")
    save_model(tmp_path / "model.json", fitted)
    again = load_model(tmp_path / "model.json")
    assert again.step_correction.factor(4, 2) == pytest.approx(correction.factor(4, 2), rel=1e-6)
    del obj["insitu_steps"]  # no in-situ steps: nothing to correct, and the file says nothing of it
    path.write_text(json.dumps(obj))
    plain = fit_profile(load_profile(path))
    assert plain.step_correction is None
    save_model(tmp_path / "plain.json", plain)
    assert "step_correction" not in json.loads((tmp_path / "plain.json").read_text())
    assert load_model(tmp_path / "plain.json").step_correction is None
