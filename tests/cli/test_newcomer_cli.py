"""Issue 15 through the CLI, without a real model pair: outputs that would destroy an input or lose a run's
measurements, non-finite numbers, and cheap checks that must come before any model is loaded."""
from __future__ import annotations

import json

import pytest

from specbatch.runtime import loading
from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import build_profile, roofline_latency, write_profile


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("newcomer_cli")
    profile = write_profile(root / "profile.json", build_profile(roofline_latency(), acceptance=[0.8, 0.75],
                                                               batch_sizes=(1, 2, 4, 8), context_lens=(128, 512),
                                                               max_k=3))
    model = root / "model.json"
    assert invoke("fit", profile, "-o", model).exit_code == 0
    return {"root": root, "profile": profile, "model": model}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Checks that must run before a model is loaded: loading one fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_checkpoint", refuse)  # the one loader, runtime.loading.load_pair,
    monkeypatch.setattr(loading, "build_model", refuse)  # builds every model through these two


@pytest.mark.parametrize("command, option", [("fit", "profile"), ("table", "model")])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(files, command, option):
    before = files[option].read_bytes()
    result = invoke(command, files[option], "-o", files[option])
    assert_one_line_error(result, "--output", "that is the input file")
    assert files[option].read_bytes() == before


@pytest.mark.parametrize("command, option", [("fit", "profile"), ("table", "model")])
def test_an_output_folder_or_device_is_refused_and_nothing_left_behind(files, tmp_path, command, option):
    for output, message in ((tmp_path, "a directory"), ("/dev/null", "not a regular file")):
        assert_one_line_error(invoke(command, files[option], "-o", output), "--output", message)
    assert list(tmp_path.iterdir()) == []


def test_a_model_file_with_a_nan_coefficient_is_refused_naming_the_field(files, tmp_path):
    text = files["model"].read_text()
    obj = json.loads(text)
    obj["roles"]["target"]["roofline"]["bandwidth_GBps"] = float("nan")
    broken = tmp_path / "nan.json"
    broken.write_text(json.dumps(obj))  # Python writes NaN, which its reader accepts
    for args in (["table", broken, "-o", tmp_path / "t.json"], ["query", broken, "--batch-size", "1"]):
        assert_one_line_error(invoke(*args), "nan.json: roles.target.roofline.bandwidth_GBps", "not a finite")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_acceptance_is_refused(files, tmp_path, value):
    assert_one_line_error(invoke("table", files["model"], "-o", tmp_path / "t.json", "--acceptance", value),
                          "--acceptance")
    assert_one_line_error(invoke("query", files["model"], "--batch-size", "1", "--acceptance", value),
                          "--acceptance")
    assert_one_line_error(invoke("bench", "--synthetic-acceptance", value, "--target", "gpt2", "--draft", "gpt2"),
                          "--synthetic-acceptance")


@pytest.mark.parametrize("args, fragments", [
    (["--temperature", "nan"], ["--temperature"]),
    (["--temperature", "inf"], ["--temperature"]),
    (["--top-p", "nan"], ["--top-p"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens must be positive"]),
    (["--threads", "0"], ["--threads must be >= 1"]),
    (["--prompts-file", "no-such-file.jsonl"], ["--prompts-file no-such-file.jsonl"]),
    (["--stage2", "x.safetensors"], ["--stage2 needs --tree"]),
    (["--model", "no-such-model.json", "--tree", "auto"], ["--model no-such-model.json: no such file"]),
    (["--model", "model.json", "--tree", "0,1"], ["--model is read only with --tree auto"]),
])
def test_generate_checks_options_before_loading_a_model(no_model_loads, args, fragments):
    assert_one_line_error(invoke("generate", "--prompt", "def f(x):", *args), *fragments)


def test_a_prompt_that_is_not_utf8_is_one_line(no_model_loads):
    # a command-line argument with the byte 0xff arrives as the lone surrogate U+DCFF (surrogateescape)
    assert_one_line_error(invoke("generate", "--prompt", "def f(x):\udcff"), "--prompt", "not UTF-8 text")


def test_bench_and_demo_check_their_output_folder_before_measuring(tmp_path, no_model_loads):
    in_the_way = tmp_path / "results"
    in_the_way.write_text("not a folder")
    assert_one_line_error(invoke("bench", "--out", in_the_way, "--batch-sizes", "1", "--ks", "0"),
                          "--out", "not a folder")
    assert_one_line_error(invoke("demo", "--out", in_the_way), "--out", "not a folder")
    assert in_the_way.read_text() == "not a folder"
    assert_one_line_error(invoke("bench", "--interleave", "rounds"), "--interleave 'rounds'", "steps, runs")


def test_calibrate_refuses_an_existing_profile_without_resume_or_force(files):
    before = files["profile"].read_bytes()
    result = invoke("calibrate", "--target", "gpt2", "--draft", "gpt2", "--acceptance", "0.8",
                    "-o", files["profile"])
    assert_one_line_error(result, "--out", "a specbatch.profile file is already there", "--resume", "--force")
    assert files["profile"].read_bytes() == before


def test_calibrate_refuses_a_profile_path_its_csv_would_overwrite(tmp_path):
    result = invoke("calibrate", "--target", "gpt2", "--draft", "gpt2", "--acceptance", "0.8", "-o", tmp_path / "p.csv")
    assert_one_line_error(result, "--out", "give the profile a .json name")


def test_calibrate_estimate_line_names_a_smaller_grid_when_the_budget_is_short():
    from specbatch.calibrate.run import DEFAULT_EFFORT, estimate_seconds
    from specbatch.console.calibration import estimate_line

    estimate = estimate_seconds(DEFAULT_EFFORT, 1, timings=100, overheads=10, trees=8)
    assert estimate == pytest.approx(64 * 1.0 + 100 * 0.25 + 10 * 0.3 + 8 * 0.2)
    assert "119 points" in estimate_line(119, estimate, None) and "--quick" not in estimate_line(119, estimate, None)
    line = estimate_line(119, estimate, 30)
    assert "--max-seconds 30 will stop it early" in line and "--quick" in line
    already_quick = estimate_line(119, estimate, 30, quick=True)  # was told to add the --quick it has
    assert "--quick" not in already_quick and "fewer --batch-sizes or --context-lens" in already_quick


def test_calibrate_off_a_terminal_prints_progress_lines_with_the_eta(capsys):
    """Its bar draws nothing off a terminal (`calibrate > log`): after 'the ETA follows' a line every
    PROGRESS_LINE_EVERY_S seconds, and the last point's."""
    from types import SimpleNamespace

    from specbatch.calibrate.summary import ProgressEvent
    from specbatch.console.bench import PROGRESS_LINE_EVERY_S
    from specbatch.console.calibration import calibrate_with_progress

    now = [0.0]

    def run(request, on_progress, on_estimate, on_notice):
        on_estimate(10, 40.0)
        for done in range(1, 11):
            now[0] += PROGRESS_LINE_EVERY_S / 2.5  # a point every 4 s
            on_progress(ProgressEvent(done, 10, f"target b={done} n=1 L=128"))
        return "summary"

    request = SimpleNamespace(max_seconds=None, out="p.json", quick=True)
    assert calibrate_with_progress(request, show=True, run=run, clock=lambda: now[0]) == "summary"
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("calibrate: 10 points to measure") and "the ETA follows" in lines[0]
    assert lines[1:] == ["calibrate: 1/10 points, target b=1 n=1 L=128; 4 s so far, ETA 36 s",
                         "calibrate: 4/10 points, target b=4 n=1 L=128; 16 s so far, ETA 24 s",
                         "calibrate: 7/10 points, target b=7 n=1 L=128; 28 s so far, ETA 12 s",
                         "calibrate: 10/10 points, target b=10 n=1 L=128; 40 s so far, ETA 0 s"]


def test_demo_says_when_the_measurement_contradicts_the_prediction():
    from types import SimpleNamespace

    from specbatch.console.demo import prediction_contradiction

    measured = dict(median_steady_tokens_per_s=400.0, p10_steady_tokens_per_s=380.0, p90_steady_tokens_per_s=420.0)
    assert prediction_contradiction(SimpleNamespace(predicted_tokens_per_s=410.0, **measured)) is None
    line = prediction_contradiction(SimpleNamespace(predicted_tokens_per_s=900.0, **measured))
    assert "predicted 900 tok/s, measured 400 (+125%)" in line and "380-420" in line
    assert prediction_contradiction(SimpleNamespace(predicted_tokens_per_s=None, **measured)) is None


def test_a_tables_second_stage_is_found_by_sha256_wherever_the_command_runs(tmp_path, monkeypatch):
    from specbatch.perfmodel.errors import UsageError
    from specbatch.perfmodel.jsonio import file_sha256
    from specbatch.runtime.assembly import DEMO_NGRAM, recorded_stage2

    monkeypatch.chdir(tmp_path)  # not the repo root: an older table's relative path names nothing here
    sha256 = file_sha256(DEMO_NGRAM)
    assert recorded_stage2({"file": "data/models/demo-ngram.safetensors", "sha256": sha256}, "t") == DEMO_NGRAM
    copy = tmp_path / "moved.safetensors"
    copy.write_bytes(DEMO_NGRAM.read_bytes())
    assert recorded_stage2({"file": str(copy), "sha256": sha256}, "t") == copy
    with pytest.raises(UsageError, match="--table t.json uses the n-gram second stage .*missing or has changed"):
        recorded_stage2({"file": str(copy), "sha256": "0" * 64}, "--table t.json")


def test_plot_refuses_a_device_a_folder_and_an_unknown_format(files, tmp_path):
    assert_one_line_error(invoke("plot", files["model"], "-o", "/dev/null"), "--output /dev/null", "regular file")
    assert_one_line_error(invoke("plot", files["model"], "-o", tmp_path), "--output", "a directory")
    assert_one_line_error(invoke("plot", files["model"], "-o", tmp_path / "figure.xyz"), "--output", ".png")
    assert list(tmp_path.iterdir()) == []
    assert invoke("plot", files["model"], "-o", tmp_path / "figure.png").exit_code == 0
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


def test_the_demo_reruns_into_its_own_folder_without_force(tmp_path, monkeypatch):
    """README's first command, run twice, used to stop at the demo: '--force' needed for its own outputs. A
    folder the demo made is its own; a user's file of another kind there is still never replaced."""
    from specbatch.console import demo

    runs = []

    def stand_in_demo(out, *args):  # writes what a run leaves: a profile, a bench file one folder down
        runs.append(out)
        (out / "profile.json").write_text('{"schema": "specbatch.profile/1"}')
        (out / "bench").mkdir(exist_ok=True)
        (out / "bench" / "bench.json").write_text('{"schema": "specbatch.bench/1"}')

    monkeypatch.setattr(demo, "run_demo", stand_in_demo)
    out = tmp_path / "specbatch-demo"
    for _ in range(2):
        result = invoke("demo", "--out", out)
        assert result.exit_code == 0, result.output
    assert len(runs) == 2 and (out / demo.DEMO_MARK).is_file()

    mine = tmp_path / "mine"  # a folder the demo did not make: its rule stays --force
    mine.mkdir()
    (mine / "profile.json").write_text('{"schema": "specbatch.profile/1"}')
    assert_one_line_error(invoke("demo", "--out", mine), "profile.json", "--force")
    (out / "table.csv").write_text("my,own,notes\n")  # another kind at a demo name, in the demo's folder
    assert_one_line_error(invoke("demo", "--out", out), "table.csv", "never replaced")
    assert (out / "table.csv").read_text() == "my,own,notes\n" and len(runs) == 2


def test_the_demo_names_its_bench_files_from_the_folder_it_names(tmp_path):
    from specbatch.console.demo import closing_line

    line = closing_line(tmp_path, [tmp_path / "bench" / "bench.json", tmp_path / "bench" / "bench.csv"])
    assert f"everything is in {tmp_path.resolve()} (bench files: bench/bench.json, bench/bench.csv;" in line
