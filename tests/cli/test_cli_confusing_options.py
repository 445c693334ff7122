"""Options a newcomer trips on: flags shown as flags, errors naming the option that was given, the
documented forms of --target, `-o` wherever `--out` is."""
from __future__ import annotations

import pytest
from typer.main import get_command

from cli_helpers import assert_one_line_error, invoke
from specbatch import cli


def _commands():
    group = get_command(cli.app)
    return sorted(group.commands)


@pytest.mark.parametrize("command", _commands())
def test_help_shows_flags_without_a_value_type(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout, command
    assert "--help" in result.stdout


def test_the_top_level_help_has_no_bool_either():
    assert "<bool>" not in invoke("--help").stdout


def test_a_flag_given_a_value_is_refused():
    result = invoke("generate", "--force", "true", "--prompt", "x")
    assert result.exit_code == 2 and "unexpected extra argument" in result.output.lower()


def test_explain_names_the_option_it_was_given():
    assert_one_line_error(invoke("explain", "model.json", "--batch-size", "1", "--k", "-2"), "--k must be >= 0, got -2")


@pytest.mark.parametrize("command", ["bench", "calibrate", "fit", "table", "plot"])
def test_o_is_a_short_form_wherever_an_output_is_written(command):
    assert "-o" in invoke(command, "--help").stdout.replace("--out", "").replace("--output", "")


def test_generate_needs_a_directory_with_a_tokenizer_as_the_readme_says():
    from specbatch.runtime.assembly import DEMO_TARGET

    readme = (DEMO_TARGET.parents[2] / "README.md").read_text()
    assert "`generate` and `serve` need" in readme and "tokenizer.json" in readme
    assert_one_line_error(invoke("generate", "--target", "llama-68m", "--prompt", "x", "--k", "0"),
                          "--target llama-68m: no tokenizer.json")
    assert_one_line_error(invoke("generate", "--target", DEMO_TARGET / "config.json", "--prompt", "x", "--k", "0"),
                          "no tokenizer.json")


# ------------------------------------------------------------------------------ the one --draft default
def test_the_draft_default_is_stated_once_for_every_command_that_takes_a_draft():
    from specbatch.console.options import DRAFT_DEFAULT_HELP

    group = get_command(cli.app)
    helps = {name: param.help for name, command in group.commands.items() for param in command.params
             if "--draft" in param.opts and name != "table"}  # table's --draft names the export's draft
    assert {"generate", "serve", "calibrate", "bench", "explain", "loadtest"} <= set(helps)
    assert all(DRAFT_DEFAULT_HELP in text for text in helps.values()), helps


def test_the_demo_draft_goes_with_the_demo_target_only(tmp_path):
    import json
    import shutil

    from specbatch.runtime.assembly import DEMO_TARGET

    result = invoke("generate", "--target", DEMO_TARGET, "--prompt", "def f", "--max-new-tokens", 2, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["policy"] == "k=4"  # the demo pair
    other = tmp_path / "target"
    shutil.copytree(DEMO_TARGET, other)
    result = invoke("generate", "--target", other, "--prompt", "def f", "--max-new-tokens", 2, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["policy"] == "k=0"  # no draft
    for command in ("calibrate", "bench"):
        assert_one_line_error(invoke(command, "--target", other, "-o", tmp_path / "out.json"),
                              f"--draft: {command} needs a draft model", f"--target {other}")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("command", [["calibrate"], ["calibrate", "--engine", "vllm"], ["bench"]])
@pytest.mark.parametrize("target, fragment", [
    ("/no/such/model", "no such model directory or config file"),
    ("not-a-preset", "not a preset"),
    ("config", "--target: "),  # a JSON that is no model's config.json
])
def test_a_target_that_is_no_model_is_named_not_the_draft(tmp_path, command, target, fragment):
    """A target that is no model used to be taken for one without a default draft: '--draft: ... give --draft'."""
    if target == "config":
        target = tmp_path / "not-a-config.json"
        target.write_text('{"hello": 1}')
    result = invoke(*command, "--target", target, "-o", tmp_path / "out")
    assert_one_line_error(result, "--target", fragment)
    assert "--draft" not in result.stderr


def test_calibrate_engine_vllm_says_vllm_is_not_set_up_before_announcing_its_start(tmp_path, monkeypatch):
    """It used to say 'starting vLLM with and without speculation...' and then that vLLM was not set up."""
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET

    monkeypatch.setenv("SPECBATCH_VLLM_VENV", str(tmp_path / "no-vllm"))
    result = invoke("calibrate", "--engine", "vllm", "--target", DEMO_TARGET, "--draft", DEMO_DRAFT,
                    "-o", tmp_path / "p.json")
    assert_one_line_error(result, "--engine vllm: vLLM is not set up in", "bench/vllm/setup.sh")
    assert "starting vLLM" not in result.output and not (tmp_path / "p.json").exists()
