"""scripts/fit_layers.py on constructed profiles: a chain k = 2 that runs 20 % slow in every lockstep sweep
is what only the step correction can see, so its paired error (held out by sweep) must fall to ~0; a
profile without in-situ steps is a one-line error."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from test_perfmodel_insitu import constructed
from test_perfmodel_steps import SPEED

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fit_layers.py"


def load_script():
    spec = importlib.util.spec_from_file_location("fit_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lockstep_profile(tmp_path, name: str, slow_k: int) -> str:
    obj = constructed(1.0, 1.0)
    one_sweep = obj["insitu_steps"]
    obj["insitu_steps"] = [dict(row, sweep=s, median_ms=row["median_ms"] * speed * (1.2 if row["k"] == slow_k else 1.0),
                                p90_ms=row["p90_ms"] * speed * 1.2)
                           for s, speed in SPEED.items() for row in one_sweep]
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def test_each_layer_is_reported_and_the_correction_sees_the_slow_chain(tmp_path, capsys):
    script = load_script()
    first, second = lockstep_profile(tmp_path, "a.json", 2), lockstep_profile(tmp_path, "b.json", 2)
    assert script.main([first, second]) == 0
    out = capsys.readouterr().out
    for layer in script.LAYERS:
        assert out.count(layer) == 2  # one line per profile
    correction_line = next(line for line in out.splitlines() if "step correction" in line and "->" in line)
    before, after = (float(x) for x in correction_line.split("(level unchanged)")[1].split("%")[0].split("->"))
    assert before > 1.0 and after < 0.1  # the 20 % slow chain, learnt from two sweeps, predicts the third
    across = [line for line in out.splitlines() if " on " in line and "layers 1-4" in line]
    assert len(across) == 2
    figures = [float(x) for x in across[0].split(":")[1].split("%")[0].split("/")]
    assert figures[3] < 0.1 < figures[2]  # another calibration's slow chain, predicted by this one's correction


def test_a_profile_without_in_situ_steps_is_one_line(tmp_path, capsys):
    obj = constructed(1.0, 1.0)
    del obj["insitu_steps"], obj["insitu_timings"]
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(obj))
    assert load_script().main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: no in-situ steps") and "\n" not in err
