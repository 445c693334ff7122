"""scripts/step_ratios.py on constructed profiles: a model fitted on steps where chain k = 2 runs 20 % slower
than its passes, set against its own profile (in-sample: the correction removes the error) and against a
profile where every step is exact (held out: the correction adds the error it learned)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

from perfmodel_fixtures import build_profile, roofline_latency

ROOT = Path(__file__).resolve().parents[2]
TRUE_MS = roofline_latency()
BATCH_SIZES, KS, CONTEXT = (1, 4, 16), (0, 2, 4, 6), 130
SPEED = {1: 1.0, 2: 2.0, 3: 0.7}  # the machine's speed in each sweep: common to the ks of a sweep
SLOW_K, SLOW = 2, 1.2


def step_ms(b: int, k: int) -> float:
    """Acceptance 0: k draft passes of 1 token, one verify pass of k + 1."""
    return k * TRUE_MS("draft", b, 1, CONTEXT) + TRUE_MS("target", b, k + 1, CONTEXT)


def profile(path: Path, slow: float) -> Path:
    obj = build_profile(TRUE_MS, batch_sizes=(1, 2, 4, 8, 16), context_lens=(128, 512), max_k=6, noise=0.0,
                        acceptance=[0.0] * 6, overheads_ms=None)
    obj["insitu_steps"] = [
        {"batch_size": b, "k": k, "context_len": CONTEXT, "tokens_per_step": 1.0, "sweep": sweep, "reps": 10,
         "median_ms": ms, "p10_ms": 0.5 * ms, "p90_ms": 2 * ms}
        for sweep, speed in SPEED.items() for b in BATCH_SIZES for k in KS
        for ms in [step_ms(b, k) * speed * (slow if k == SLOW_K else 1.0)]]
    path.write_text(json.dumps(obj))
    return path


def test_step_ratios_in_sample_and_held_out(tmp_path):
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import save_model
    from specbatch.perfmodel.profile import load_profile

    slow_profile, exact_profile = profile(tmp_path / "slow.json", SLOW), profile(tmp_path / "exact.json", 1.0)
    model = tmp_path / "model.json"
    save_model(model, fit_profile(load_profile(slow_profile)))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_ratios.py"), "--models", str(model),
                          "--profiles", f"{slow_profile},{exact_profile}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    figures = {Path(line.split(", ")[1].split(":")[0]).name: [float(x) for x in re.findall(r"(-?[\d.]+) %", line)]
               for line in run.stdout.splitlines()[1:]}
    # one ratio of four 20 % off: each k's paired residual is its log ratio less the four's mean, so the mean
    # |residual| is (3/4 + 3 x 1/4) / 4 x ln 1.2
    off_pct = 100 * 0.375 * math.log(SLOW)
    (in_plain, in_corrected), (out_plain, out_corrected) = figures["slow.json"], figures["exact.json"]
    assert abs(in_plain - off_pct) < 0.02 and in_corrected < 0.02
    assert out_plain < 0.02 and abs(out_corrected - off_pct) < 0.02


def test_a_missing_model_file_is_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_ratios.py"), "--models",
                          str(tmp_path / "none.json"), "--profiles", str(tmp_path / "none.json")],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "none.json" in run.stderr
