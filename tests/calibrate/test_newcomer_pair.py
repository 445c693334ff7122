"""Issue 15 on a tiny real pair (the calibration tests' `pair`): a calibration never destroys a profile and
holds a lock while it runs, it stops cleanly on --max-seconds, models are recognised by content, a table
made for another pair is refused, and broken checkpoints are one-line errors in every command."""
from __future__ import annotations

import json
import shutil

import pytest

from specbatch.calibrate.run import calibrate
from cli_helpers import assert_one_line_error, invoke
from specbatch.perfmodel.jsonio import exclusive_lock
from specbatch.perfmodel.profile import load_profile
from test_calibrate_run import pair, request  # noqa: F401 - `pair` is a fixture

GRID = ["--device", "cpu", "--batch-sizes", "1,2", "--context-lens", "8", "--max-k", "1", "--quick", "--threads", "1"]


def cli_calibrate(pair, out, *args):
    return invoke("calibrate", "--target", pair / "target", "--draft", pair / "draft", "--prompts",
                  pair / "prompts.jsonl", "--no-stage2", "-o", out, *GRID, *args)


@pytest.fixture(scope="module")
def profile(pair, tmp_path_factory):
    """A complete tiny profile through the CLI (with --threads 1), and the model and table made from it."""
    root = tmp_path_factory.mktemp("newcomer_pair")
    result = cli_calibrate(pair, root / "p.json", "--json")
    assert result.exit_code == 0, result.output
    assert invoke("fit", root / "p.json", "-o", root / "m.json").exit_code == 0
    assert invoke("table", root / "m.json", "-o", root / "t.json", "--max-batch", "4").exit_code == 0
    return root


def test_threads_are_recorded_and_sources_are_absolute_with_a_fingerprint(pair, profile):
    loaded = load_profile(profile / "p.json")
    assert loaded.device.cpu_threads == 1
    assert loaded.target.source == str((pair / "target").resolve()) and len(loaded.target.fingerprint) == 64
    table = json.loads((profile / "t.json").read_text())
    assert table["fingerprints"] == {"target": loaded.target.fingerprint, "draft": loaded.draft.fingerprint}


def test_an_existing_profile_is_kept_when_the_new_run_fails_before_its_first_point(pair, profile, tmp_path):
    out = tmp_path / "p.json"
    shutil.copy(profile / "p.json", out)
    before = out.read_bytes()
    broken = tmp_path / "target"
    shutil.copytree(pair / "target", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated mid-file
    result = invoke("calibrate", "--target", broken, "--draft", pair / "draft", "--prompts", pair / "prompts.jsonl",
                    "--no-stage2", "-o", out, "--force", *GRID)
    assert_one_line_error(result, "weights are not readable")
    assert out.read_bytes() == before and not (tmp_path / "p.csv").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "target"]  # no lock, no temporary


def test_a_second_calibration_of_one_output_is_refused_while_the_first_runs(pair, tmp_path):
    out = tmp_path / "p.json"
    with exclusive_lock(out, "--out", "calibration"):  # stands in for a first run still measuring
        assert_one_line_error(cli_calibrate(pair, out), "--out", "another calibration is writing it")
    assert not out.exists()


def test_max_seconds_stops_cleanly_with_the_profile_saved_and_resume_continues(pair, tmp_path):
    out = tmp_path / "p.json"
    ticks = iter(range(10**6))
    summary = calibrate(request(pair, out, max_seconds=0.5), clock=lambda: float(next(ticks)))  # 1 s per tick
    assert summary.points_measured == 1 and summary.points_left > 0  # the first point, then out of time
    assert len(load_profile(out).acceptance) == 1
    resumed = calibrate(request(pair, out, resume=True))
    assert resumed.points_resumed == 1 and resumed.points_left == 0


def test_resume_recognises_the_same_models_under_another_path(pair, profile, tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    shutil.copy(profile / "p.json", out)
    (tmp_path / "elsewhere").symlink_to(pair)
    monkeypatch.chdir(tmp_path)
    result = invoke("calibrate", "--target", "elsewhere/target", "--draft", "elsewhere/draft", "--prompts",
                    pair / "prompts.jsonl", "--no-stage2", "-o", "p.json", "--resume", "--json", *GRID)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["points_measured"] == 0


def test_a_table_made_for_another_pair_is_refused_unless_forced(pair, profile, tmp_path):
    other = json.loads((profile / "t.json").read_text())
    other["fingerprints"]["target"] = "ab" * 32
    table = tmp_path / "other.json"
    table.write_text(json.dumps(other))
    args = ["--target", pair / "target", "--draft", pair / "draft", "--table", table, "--threads", "1"]
    result = invoke("generate", "--prompt", "def f(x):", "--max-new-tokens", "4", *args)
    assert_one_line_error(result, f"--table {table} was made for another pair: target", "abababababab", "--force")
    assert invoke("generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--force", *args).exit_code == 0
    result = invoke("bench", *args, "--batch-sizes", "1", "--ks", "0", "--out", tmp_path / "bench")
    assert_one_line_error(result, f"--table {table} was made for another pair")


def test_a_table_range_warning_is_one_note_in_the_clis_voice(pair, profile):
    result = invoke("generate", "--prompt", "a", "--prompt", "bb", "--max-new-tokens", "4", "--table",
                    profile / "t.json", "--target", pair / "target", "--draft", pair / "draft", "--threads", "1")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if "outside the buckets" in line]
    assert len(notes) == 1 and notes[0].startswith("note: table: context length")
    assert "TableRangeWarning" not in result.output and "warnings.warn" not in result.output


@pytest.fixture(scope="module")
def broken_targets(pair, tmp_path_factory):
    """The target truncated in its header, truncated mid-file, and with a config of fewer layers."""
    root = tmp_path_factory.mktemp("broken")
    weights = (pair / "target" / "model.safetensors").read_bytes()
    cases = {"header": weights[:4], "middle": weights[:len(weights) // 2], "layers": weights}
    for name, data in cases.items():
        shutil.copytree(pair / "target", root / name)
        (root / name / "model.safetensors").write_bytes(data)
    config = json.loads((root / "layers" / "config.json").read_text())
    (root / "layers" / "config.json").write_text(json.dumps(replace_layers(config, 1)))
    return root


def replace_layers(config: dict, layers: int) -> dict:
    return {**config, "num_hidden_layers": layers}


@pytest.mark.parametrize("case, message", [("header", "weights are not readable"),
                                           ("middle", "weights are not readable"),
                                           ("layers", "tensor(s) the config does not use")])
def test_a_broken_checkpoint_is_one_line_in_every_command(pair, broken_targets, tmp_path, case, message):
    target = broken_targets / case
    draft = ["--draft", pair / "draft", "--threads", "1"]
    assert_one_line_error(invoke("generate", "--prompt", "x", "--target", target, *draft), message)
    assert_one_line_error(invoke("bench", "--target", target, *draft, "--batch-sizes", "1", "--ks", "0",
                                 "--out", tmp_path / "bench"), message)
    assert_one_line_error(invoke("calibrate", "--target", target, "--draft", pair / "draft", "--prompts",
                                 pair / "prompts.jsonl", "--no-stage2", "-o", tmp_path / "p.json", *GRID), message)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing left behind


def test_calibrate_says_its_estimate_first_and_what_max_seconds_left(pair, tmp_path):
    result = cli_calibrate(pair, tmp_path / "p.json", "--max-seconds", "0.001")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "points to measure, about " in said and "--max-seconds 0.001 will stop it early" in said
    said = " ".join(result.stdout.split())  # rich wraps long lines
    assert "stopped after --max-seconds 0.001:" in said and "rerun with --resume" in said
    assert json.loads((tmp_path / "p.json").read_text())["stopped_early"] == "--max-seconds 0.001"  # fit says so
