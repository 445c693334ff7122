"""Does a model's in-situ step correction predict another calibration's lockstep steps?

    python scripts/step_ratios.py --models m1.json,m2.json --profiles p1.json,p2.json
"""
from __future__ import annotations

import argparse


def errors(model_path: str, profile_path: str) -> tuple[float | None, float | None]:
    """(uncorrected, corrected) paired step error of `model_path` on `profile_path`'s lockstep steps, in %."""
    from specbatch.perfmodel.fit import predict_steps
    from specbatch.perfmodel.model import load_model
    from specbatch.perfmodel.profile import load_profile
    from specbatch.perfmodel.steps import paired_error_pct

    fitted, profile = load_model(model_path), load_profile(profile_path)
    greedy = next((a for a in fitted.acceptance if a.mode == "greedy"), None)
    if greedy is None:
        raise SystemExit(f"{model_path}: no greedy acceptance: the in-situ steps ran greedily")
    steps = profile.insitu_steps
    plain = predict_steps(fitted.latency_ms, fitted.overhead, greedy, steps)
    correction = fitted.step_correction
    corrected = plain if correction is None else \
        [ms * correction.factor(row.batch_size, row.k) for ms, row in zip(plain, steps)]
    return paired_error_pct(steps, plain), paired_error_pct(steps, corrected)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Prints the paired step-time error (perfmodel.steps.paired_error_pct) of each model, without and "
               "with its correction, on each profile's in-situ steps: on its own profile a model is in-sample, on "
               "another calibration's it is held out.")
    parser.add_argument("--models", required=True, help="comma-separated model files (specbatch fit)")
    parser.add_argument("--profiles", required=True, help="comma-separated profiles with in-situ steps in sweeps")
    args = parser.parse_args(argv)
    from specbatch.perfmodel.errors import PerfModelError  # after the options: --help answers at once

    print("model, profile: paired step error by the model alone -> with its correction")
    for model_path in args.models.split(","):
        for profile_path in args.profiles.split(","):
            try:
                plain, corrected = errors(model_path, profile_path)
            except PerfModelError as error:
                raise SystemExit(f"error: {error}") from None
            if plain is None:
                print(f"{model_path}, {profile_path}: no lockstep steps (sweeps) to pair")
                continue
            print(f"{model_path}, {profile_path}: {plain:.2f} % -> {corrected:.2f} %")


if __name__ == "__main__":
    main()
