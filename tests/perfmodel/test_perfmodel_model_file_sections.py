"""Every section of a hand-edited model.json (the roles with a staircase, coverage, an engine's step model) is
read by the profile's field rules: a broken field is one line naming the file, the path to the field and the
rule it breaks, never a Python exception's name (`malformed (KeyError: 'planned_points')`)."""
from __future__ import annotations

import copy
import json
import re

import pytest

from perfmodel_fixtures import build_profile, roofline_latency
from specbatch.perfmodel.coverage import Coverage
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import model_from_json, model_to_json
from specbatch.perfmodel.profile import profile_from_json
from test_perfmodel_engine_steps import engine_profile

# what a reader that let a Python exception through would print
PYTHON_NAMES = re.compile(r"KeyError|TypeError|ValueError|IndexError|AttributeError|malformed|NoneType")
STAIRCASE = {"base": {"roofline_work": 1.0, "compute": 0.0, "fixed_ms": 0.1, "per_row": 0.01, "kv_read": 0.0},
             "tile_tokens": None, "wave_rows": 4.0, "row_cost_from": 2.0,
             "steps": [{"axis": "tokens", "after": 16.0, "until": 32.0, "sharp": True, "coefficient": 0.5}]}


@pytest.fixture(scope="module")
def roles_model() -> dict:
    """A pass-latency model whose target is a staircase and whose profile was cut short (coverage)."""
    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=3,
                        acceptance=[0.7] * 3)
    model = json.loads(json.dumps(model_to_json(fit_profile(profile_from_json(obj)))))
    model["roles"]["target"].update(kind="roofline+staircase", staircase=copy.deepcopy(STAIRCASE))
    model["coverage"] = Coverage(40, 30, (("target", 8, 512),), 16, 12, "--max-seconds 30").to_json()
    return model


@pytest.fixture(scope="module")
def engine_model() -> dict:
    return json.loads(json.dumps(model_to_json(fit_profile(profile_from_json(engine_profile(sweeps=1))))))


def read_error(obj: dict) -> str | None:
    try:
        model_from_json(obj, "m.json")
    except PerfModelError as error:
        return str(error)
    return None


def test_both_files_read_back_as_written(roles_model, engine_model):
    fitted = model_from_json(roles_model, "m.json")
    assert fitted.roles["target"].model.staircase.steps[0].after == 16.0
    assert fitted.coverage.missing_cells == (("target", 8, 512),)
    assert model_from_json(engine_model, "m.json").engine.points


@pytest.mark.parametrize("section, edit, message", [
    ("roles", lambda o: o["coverage"].pop("planned_points"), "m.json: coverage.planned_points: missing"),
    ("roles", lambda o: o["coverage"].update(measured_points=41),
     "m.json: coverage.measured_points: at most planned_points = 40, found 41"),
    ("roles", lambda o: o["coverage"].update(missing_cells=[["verifier", 8, 512]]),
     "m.json: coverage.missing_cells[0]: expected [role, batch_size, context_len] (a role of target, draft"),
    ("roles", lambda o: o["coverage"].update(stopped_by=None), "m.json: coverage.stopped_by: expected a string"),
    ("roles", lambda o: o["roles"]["target"]["staircase"]["steps"][0].pop("axis"),
     "m.json: roles.target.staircase.steps[0].axis: missing"),
    ("roles", lambda o: o["roles"]["target"]["staircase"]["steps"][0].update(until=8.0),
     "m.json: roles.target.staircase.steps[0]: expected after < until, found 16.0 and 8.0"),
    ("roles", lambda o: o["roles"]["target"]["staircase"]["steps"][0].update(sharp="yes"),
     "m.json: roles.target.staircase.steps[0].sharp: expected true or false, found 'yes'"),
    ("roles", lambda o: o["roles"]["target"]["staircase"]["base"].update(per_row="0.01"),
     "m.json: roles.target.staircase.base.per_row: expected a number, found '0.01'"),
    ("roles", lambda o: o["roles"]["target"]["staircase"].update(wave_rows=0.5),
     "m.json: roles.target.staircase.wave_rows: must be >= 1.0, found 0.5"),
    ("engine", lambda o: o["engine_steps"]["terms"].pop("row_ms"), "m.json: engine_steps.terms.row_ms: missing"),
    ("engine", lambda o: o["engine_steps"]["terms"].update(row_ms=-0.3),
     "m.json: engine_steps.terms.row_ms: must be >= 0.0, found -0.3"),
    ("engine", lambda o: o["engine_steps"]["points"][0].pop("median_ms"),
     "m.json: engine_steps.points[0].median_ms: missing"),
    ("engine", lambda o: o["engine_steps"]["points"][0].update(mode="eager"),
     "m.json: engine_steps.points[0].mode: 'eager' is not one of none, schedule"),
    ("engine", lambda o: o["engine_steps"].update(points=[]),
     "m.json: engine_steps.points: expected the fitted configurations, found none"),
    ("engine", lambda o: o["engine_steps"]["held_out"][0].update(per_group={"x": 1.0}),
     "m.json: engine_steps.held_out[0].per_group: expected a k for each key, found 'x'"),
    ("engine", lambda o: o["engine_steps"]["engine"].pop("version"), "m.json: engine_steps.engine.version: missing"),
])
def test_a_broken_field_is_named_with_its_rule(roles_model, engine_model, section, edit, message):
    obj = copy.deepcopy(roles_model if section == "roles" else engine_model)
    edit(obj)
    error = read_error(obj)
    assert error is not None and error.startswith(message), error
    assert "\n" not in error and not PYTHON_NAMES.search(error), error


def breakages(obj, path=()):
    """(path, edit) for each field below `obj`: removed, null, a string, a negative number, an empty list, an
    object; of a list, its first element only (the rest are read alike)."""
    keys = list(obj) if isinstance(obj, dict) else [0] if isinstance(obj, list) and obj else []
    for key in keys:
        for replacement in ("<removed>", None, "x", -1, [], {}):
            yield path + (key,), replacement
        if isinstance(obj[key], (dict, list)):
            yield from breakages(obj[key], path + (key,))


def broken(obj: dict, path: tuple, replacement) -> dict:
    obj = copy.deepcopy(obj)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if replacement == "<removed>":
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return obj


@pytest.mark.parametrize("section", ["coverage", "roles", "engine_steps"])
def test_no_broken_field_of_a_section_names_a_python_exception(roles_model, engine_model, section):
    """Every field of the section broken in turn: read, or refused in one line naming the section."""
    whole = engine_model if section == "engine_steps" else roles_model
    target = whole[section] if section != "roles" else {"target": whole["roles"]["target"]}
    prefix = (section,) if section != "roles" else ("roles",)
    for path, replacement in breakages(target):
        error = read_error(broken(whole, prefix + path, replacement))
        if error is not None:
            assert error.startswith(f"m.json: {section}") and "\n" not in error, (path, replacement, error)
            assert not PYTHON_NAMES.search(error), (path, replacement, error)


def test_a_value_no_reader_foresaw_is_named_by_its_section(roles_model, monkeypatch):
    """The last net under the readers: one line naming the file and the section, not the exception."""
    def unforeseen(obj, where):
        raise KeyError("planned_points")

    monkeypatch.setattr(Coverage, "from_json", unforeseen)
    assert read_error(roles_model) == "m.json: coverage: not in the form `specbatch fit` writes; fit the profile again"
