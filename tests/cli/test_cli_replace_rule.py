"""One rule for every writer: an output of the same kind is replaced only with --force; a file of another
kind (a profile under fit -o, notes under table -o, earlier bench results under plot -o) is never replaced."""
from __future__ import annotations

import json

import pytest
from typer.main import get_command

from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import build_profile, roofline_latency, write_profile
from specbatch import cli
from specbatch.perfmodel.jsonio import REPLACE_RULE_HELP


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("replace")
    profile = write_profile(root / "profile.json", build_profile(roofline_latency(), batch_sizes=(1, 2, 4),
                                                                 context_lens=(64, 256), max_k=3, acceptance=[0.6]))
    assert invoke("fit", profile, "-o", root / "model.json").exit_code == 0
    return {"profile": root / "profile.json", "model": root / "model.json"}


def test_fit_never_replaces_a_profile_and_replaces_a_model_only_with_force(files, tmp_path):
    other = tmp_path / "other-profile.json"
    other.write_bytes(files["profile"].read_bytes())
    for force in ((), ("--force",)):
        assert_one_line_error(invoke("fit", files["profile"], "-o", other, *force), f"--output {other}",
                              "a specbatch.profile file is there, not a specbatch.model file", "never replaced")
    assert other.read_bytes() == files["profile"].read_bytes()
    model = tmp_path / "model.json"
    model.write_text(json.dumps({**json.loads(files["model"].read_text()), "marker": 1}))
    assert_one_line_error(invoke("fit", files["profile"], "-o", model), "a specbatch.model file is already there",
                          "--force")
    assert "marker" in json.loads(model.read_text())
    assert invoke("fit", files["profile"], "-o", model, "--force").exit_code == 0
    assert "marker" not in json.loads(model.read_text())


@pytest.mark.parametrize(("fmt", "name"), [("json", "t.json"), ("csv", "t.csv"), ("vllm", "v.json")])
def test_table_never_replaces_notes_and_replaces_its_own_kind_only_with_force(files, tmp_path, fmt, name):
    notes = tmp_path / name
    notes.write_text("notes, to keep\n")
    from specbatch.runtime.assembly import DEMO_DRAFT

    args = ("table", files["model"], "--format", fmt, "--strategies", "chain", "--max-batch", 4,
            *(("--draft", DEMO_DRAFT) if fmt == "vllm" else ()))
    assert_one_line_error(invoke(*args, "-o", notes, "--force"), f"--output {notes}", "never replaced")
    assert notes.read_text() == "notes, to keep\n"
    table = tmp_path / f"again-{name}"
    assert invoke(*args, "-o", table).exit_code == 0
    assert_one_line_error(invoke(*args, "-o", table), "already there", "--force")
    assert invoke(*args, "-o", table, "--force").exit_code == 0
    if fmt != "vllm":  # a table JSON and its CSV are different kinds
        other = "csv" if fmt == "json" else "json"
        assert_one_line_error(invoke("table", files["model"], "--format", other, "-o", table, "--force"),
                              "never replaced")


def test_plot_and_bench_refuse_other_kinds_before_any_work(files, tmp_path):
    image = tmp_path / "plot.png"
    image.write_bytes(files["profile"].read_bytes())
    assert_one_line_error(invoke("plot", files["model"], "-o", image, "--force"), "a specbatch.profile file is there")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "bench.json").write_text('{"schema": "specbatch.bench/1"}')
    assert_one_line_error(invoke("bench", "--out", tmp_path / "bench"), "bench.json",
                          "a specbatch.bench file is already there", "--force")
    (tmp_path / "bench" / "bench.csv").write_text("my,own,notes\n")
    assert_one_line_error(invoke("bench", "--out", tmp_path / "bench", "--force"), "bench.csv", "never replaced")


def test_an_empty_placeholder_is_replaced_with_force(files, tmp_path):
    placeholder = tmp_path / "m.json"
    placeholder.touch()
    assert_one_line_error(invoke("fit", files["profile"], "-o", placeholder), "an empty file is already there",
                          "--force")
    assert invoke("fit", files["profile"], "-o", placeholder, "--force").exit_code == 0


def test_calibrate_never_replaces_another_kind_even_with_force(files, tmp_path):
    notes = tmp_path / "p.json"
    notes.write_text('{"my": "notes"}')
    result = invoke("calibrate", "--target", "gpt2", "--draft", "gpt2", "--acceptance", "0.8", "-o", notes, "--force")
    assert_one_line_error(result, f"--out {notes}", "never replaced")
    assert notes.read_text() == '{"my": "notes"}'
    beside = tmp_path / "q.csv"  # the timing CSV calibrate writes beside its profile
    beside.write_text("my,own,notes\n")
    result = invoke("calibrate", "--target", "gpt2", "--draft", "gpt2", "--acceptance", "0.8",
                    "-o", tmp_path / "q.json", "--force")
    assert_one_line_error(result, f"--out {beside}", "never replaced")
    assert beside.read_text() == "my,own,notes\n" and not (tmp_path / "q.json").exists()


def test_every_command_that_writes_files_states_the_rule_identically():
    group = get_command(cli.app)
    writers = {name for name, command in group.commands.items() for param in command.params
               if {"-o", "--out", "--output"} & set(param.opts)}
    assert {"fit", "table", "plot", "bench", "calibrate", "demo", "loadtest"} <= writers
    for name in writers:
        force = [p for p in group.commands[name].params if "--force" in p.opts]
        assert force and REPLACE_RULE_HELP in force[0].help, name
