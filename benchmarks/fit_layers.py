"""What each layer of `fit` earns on held-out steps: roofline, its monotone refinement, the timing-source
choice and the in-situ step correction, on one or more calibrations' profiles.

    python scripts/fit_layers.py p1.json [p2.json ...]

For each profile with in-situ steps it prints, per layer, the held-out step MAPE (each batch size's rows
left out of the fit, its steps predicted) and the paired step error (how far the model's ratios between
the ks of one batch size are from the ratios measured side by side; the correction's own figure is held
out by sweep). With several profiles it also predicts each profile's steps from every other profile's
model: a held-out test across calibrations.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.fit import (fit_profile, fit_role, held_out_by_batch_size, overhead_model, predict_steps,
                                     source_points)
from specbatch.perfmodel.fields import ROLES
from specbatch.perfmodel.profile import load_profile
from specbatch.perfmodel.steps import ISOLATED, paired_error_pct

LAYERS = ("roofline", "+ monotone refinement (by CV)", "+ timing source (by held-out steps)",
          "+ in-situ step correction")


def layer_models(profile):
    """layer -> ({role: LatencyModel}, source, correction or None), each layer adding one to the last."""
    roofline = {}
    for role in ROLES:
        points = source_points(profile, role, ISOLATED)
        shape = lat.RoleShape.from_model_info(profile.model(role))
        roofline[role] = lat.fit_latency_model(shape, points, lat.ROOFLINE)
    refined = {role: fit_role(profile, role, False).model for role in ROLES}
    fitted = fit_profile(profile)
    source = fitted.timing_source.chosen if fitted.timing_source else ISOLATED
    chosen = {role: fit.model for role, fit in fitted.roles.items()}
    return {LAYERS[0]: (roofline, ISOLATED, None), LAYERS[1]: (refined, ISOLATED, None),
            LAYERS[2]: (chosen, source, None), LAYERS[3]: (chosen, source, fitted.step_correction)}, fitted


def predicted_ms(models, overhead, acceptance, steps, correction):
    latency = lambda role, b, n, L: models[role].latency_ms(b, n, L)  # noqa: E731
    predicted = predict_steps(latency, overhead, acceptance, steps)
    if correction is not None and correction.applied:
        predicted = predicted * np.array([correction.factor(s.batch_size, s.k) for s in steps])
    return predicted


def report(paths: list[str]) -> None:
    profiles = {path: load_profile(path) for path in paths}
    layered = {}
    for path, profile in profiles.items():
        if not profile.insitu_steps:
            raise PerfModelError(f"{path}: no in-situ steps: calibrate without --quick records them")
        layers, fitted = layer_models(profile)
        layered[path] = (layers, fitted)
        acceptance = next(a for a in fitted.acceptance if a.mode == "greedy")
        overhead = overhead_model(profile)
        measured = np.array([s.median_ms for s in profile.insitu_steps])
        noise = "" if fitted.noise is None else f", noise floor {100 * fitted.noise.floor_mape:.1f} %"
        print(f"\n{path}: {len(measured)} in-situ steps{noise}")
        print(f"  {'layer':40s} {'held-out step MAPE':>20s} {'paired step error':>20s}")
        for name, (models, source, correction) in layers.items():
            if correction is None:
                _, held = held_out_by_batch_size(profile, source, models, overhead, acceptance)
                held_text = "n/a" if np.isnan(held).any() else f"{lat.mape_pct(held, measured):.2f} %"
                paired = paired_error_pct(profile.insitu_steps,
                                          predicted_ms(models, overhead, acceptance, profile.insitu_steps, None))
                paired_text = "n/a" if paired is None else f"{paired:.2f} %"
            else:
                held_text = "(level unchanged)"
                paired_text = (f"{correction.heldout_uncorrected_pct:.2f} -> {correction.heldout_error_pct:.2f} %"
                               f"{'' if correction.applied else ' (not applied)'} by sweep")
            print(f"  {name:40s} {held_text:>20s} {paired_text:>20s}")
    if len(paths) < 2:
        return
    print("\nacross calibrations: paired step error of one profile's model on another's steps")
    for source_path, (layers, fitted) in layered.items():
        acceptance = next(a for a in fitted.acceptance if a.mode == "greedy")
        for target_path, profile in profiles.items():
            if target_path == source_path:
                continue
            figures = []
            for name in LAYERS:
                models, _, correction = layers[name]
                predicted = predicted_ms(models, fitted.overhead, acceptance, profile.insitu_steps, correction)
                paired = paired_error_pct(profile.insitu_steps, predicted)
                figures.append("n/a" if paired is None else f"{paired:.2f}")
            print(f"  {source_path} on {target_path}: " + " / ".join(figures) + " %  (layers 1-4)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", help="specbatch.profile/1 files with in-situ steps")
    args = parser.parse_args(argv)
    try:
        report(args.profiles)
    except PerfModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
