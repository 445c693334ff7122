"""Writes the system refuses: a full disk, a read-only file system, a folder we may not write, a standard
output that takes no bytes. Every command ends with one `error:` line naming the file (or standard output)
and the system's reason, exit code 2, no traceback; an existing file is never lost (the atomic writer
replaces it only with a complete new one) and no temporary file is left behind."""
from __future__ import annotations

import json
import shutil

import pytest

from cli_helpers import invoke
from os_faults import (
    assert_one_error_line, on_full_disk, on_read_only, run_specbatch, without_root_override,
)
from perfmodel_fixtures import build_profile, roofline_latency, write_profile

FULL = "No space left on device"
TINY_CALIBRATION = ["--quick", "--batch-sizes", "1", "--context-lens", "16", "--max-k", "1", "--no-stage2",
                    "--threads", "1"]
TINY_BENCH = ["--batch-sizes", "1", "--ks", "0", "--rounds", "1", "--resolve-rounds", "0", "--max-new-tokens", "4",
              "--threads", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("write_failures")
    # batch sizes up to 64: the fit settles in a fraction of the time it takes on three (each fit below runs it)
    profile = write_profile(root / "profile.json", build_profile(roofline_latency(), acceptance=[0.8, 0.75],
                                                               batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                                                               context_lens=(128, 512), max_k=2))
    model = root / "model.json"
    assert invoke("fit", profile, "-o", model).exit_code == 0
    return {"profile": profile, "model": model}


def _seed(tmp_path, **old_files):
    seed = tmp_path / "seed"
    seed.mkdir()
    for name, text in old_files.items():
        (seed / name.replace("_", ".")).write_text(text)
    return seed


# ------------------------------------------------------------------------------------------------ full disk
@pytest.mark.parametrize("command, written", [
    (["fit", "{profile}", "-o", "{disk}/m.json"], "m.json"),
    (["table", "{model}", "-o", "{disk}/t.json"], "t.json"),
    (["table", "{model}", "--format", "csv", "-o", "{disk}/t.csv"], "t.csv"),
    (["plot", "{model}", "-o", "{disk}/p.png"], "p.png"),
])
def test_a_full_disk_is_one_line_and_leaves_nothing_behind(files, tmp_path, command, written):
    disk, keep = tmp_path / "disk", tmp_path / "after"
    prefix = on_full_disk(disk, _seed(tmp_path), keep)
    args = [part.format(disk=disk, **files) for part in command]
    assert_one_error_line(run_specbatch(*args, prefix=prefix), f"{disk}/{written}", FULL, "nothing was written")
    assert sorted(p.name for p in keep.iterdir()) == []  # no temporary file left


@pytest.mark.parametrize("command, name, old", [
    (["fit", "{profile}", "-o", "{disk}/m.json", "--force"], "m.json", '{"schema": "specbatch.model/1"}'),
    (["table", "{model}", "-o", "{disk}/t.json", "--force"], "t.json", '{"schema": "specbatch.table/1"}'),
])
def test_replacing_a_file_on_a_full_disk_keeps_the_old_one(files, tmp_path, command, name, old):
    disk, keep = tmp_path / "disk", tmp_path / "after"
    prefix = on_full_disk(disk, _seed(tmp_path, **{name.replace(".", "_"): old}), keep)
    args = [part.format(disk=disk, **files) for part in command]
    assert_one_error_line(run_specbatch(*args, prefix=prefix), f"{disk}/{name}", FULL, "existing file is unchanged")
    assert [p.name for p in keep.iterdir()] == [name] and (keep / name).read_text() == old


@pytest.mark.slow
def test_calibrate_on_a_full_disk_keeps_the_profile_it_would_replace(tmp_path):
    disk, keep = tmp_path / "disk", tmp_path / "after"
    old = '{"schema": "specbatch.profile/1", "the old": "profile"}'
    prefix = on_full_disk(disk, _seed(tmp_path, p_json=old), keep)
    result = run_specbatch("calibrate", "-o", disk / "p.json", "--force", *TINY_CALIBRATION, prefix=prefix)
    assert_one_error_line(result, f"{disk}/p.json", FULL, "lock file")
    assert (keep / "p.json").read_text() == old
    assert sorted(p.name for p in keep.iterdir()) == ["p.json"]  # neither a temporary file nor a lock


@pytest.mark.slow
def test_bench_on_a_full_disk_names_the_file(tmp_path):
    disk, keep = tmp_path / "disk", tmp_path / "after"
    prefix = on_full_disk(disk, _seed(tmp_path), keep)
    result = run_specbatch("bench", "--out", disk / "b", *TINY_BENCH, prefix=prefix)
    assert_one_error_line(result, f"{disk}/b/bench", FULL)


# ------------------------------------------------------------------------------------ read-only file system
@pytest.mark.parametrize("command, name", [
    (["fit", "{profile}", "-o", "{ro}/m.json"], "m.json"),
    (["table", "{model}", "--format", "csv", "-o", "{ro}/t.csv"], "t.csv"),
])
def test_a_read_only_file_system_is_one_line(files, tmp_path, command, name):
    read_only = tmp_path / "ro"
    prefix = on_read_only(read_only)
    args = [part.format(ro=read_only, **files) for part in command]
    assert_one_error_line(run_specbatch(*args, prefix=prefix), f"{read_only}/{name}", "Read-only file system")


# ---------------------------------------------------------------------------------------- permission denied
@pytest.fixture
def locked(tmp_path):
    """A folder nobody may write into, and one nobody may even list."""
    no_write, no_access = tmp_path / "no-write", tmp_path / "no-access"
    no_write.mkdir()
    no_access.mkdir()
    no_write.chmod(0o555)
    no_access.chmod(0o000)
    yield {"no_write": no_write, "no_access": no_access}
    no_write.chmod(0o755)
    no_access.chmod(0o755)


@pytest.mark.parametrize("command, path", [
    (["fit", "{profile}", "-o", "{no_write}/m.json"], "{no_write}/m.json"),
    (["fit", "{profile}", "-o", "{no_access}/m.json"], "{no_access}/m.json"),
    (["table", "{model}", "-o", "{no_write}/t.json"], "{no_write}/t.json"),
    (["plot", "{model}", "-o", "{no_write}/p.png"], "{no_write}/p.png"),
    (["bench", "--out", "{no_write}/b", *TINY_BENCH], "{no_write}/b"),  # before any model loads
    (["demo", "--out", "{no_write}/demo"], "{no_write}/demo"),
])
def test_a_folder_we_may_not_write_is_one_line(files, locked, command, path):
    args = [part.format(**files, **locked) for part in command]
    result = run_specbatch(*args, prefix=without_root_override())
    assert_one_error_line(result, path.format(**locked), "Permission denied")
    assert not any(locked["no_write"].iterdir())


def test_an_unreadable_config_json_is_one_line(tmp_path):
    from specbatch.runtime.assembly import DEMO_TARGET

    target = tmp_path / "target"
    shutil.copytree(DEMO_TARGET, target)
    (target / "config.json").chmod(0o000)
    result = run_specbatch("generate", "--target", target, "--prompt", "x", "--max-new-tokens", "2",
                           prefix=without_root_override())
    assert_one_error_line(result, "--target", f"{target}/config.json", "cannot read", "Permission denied")


def test_unreadable_weights_are_reported_as_unreadable_not_missing(tmp_path):
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET

    target = tmp_path / "target"
    shutil.copytree(DEMO_TARGET, target)
    (target / "model.safetensors").chmod(0o000)
    for command in (["generate", "--prompt", "x", "--max-new-tokens", "2", "--k", "0"],
                    ["bench", "--batch-sizes", "1", "--ks", "0", "--out", tmp_path / "b", "--draft", DEMO_DRAFT]):
        result = run_specbatch(*command, "--target", target, prefix=without_root_override())
        line = assert_one_error_line(result, f"{target}/model.safetensors", "Permission denied")
        assert "no weights" not in line


# ---------------------------------------------------------------------------------------- a full stdout
@pytest.mark.parametrize("command", [
    ["query", "{model}", "--batch-size", "2"],
    ["query", "{model}", "--batch-size", "2", "--json"],
    ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--threads", "1"],
    ["generate", "--prompt", "def f(x):", "--max-new-tokens", "4", "--threads", "1", "--json"],
])
def test_a_full_standard_output_is_one_line(files, command):
    with open("/dev/full", "w") as full:
        result = run_specbatch(*[part.format(**files) for part in command], stdout=full)
    assert_one_error_line(result, "cannot write standard output", FULL)


def test_the_same_commands_write_their_output_when_stdout_takes_it(files):
    answer = run_specbatch("query", files["model"], "--batch-size", "2", "--json")
    assert answer.returncode == 0 and json.loads(answer.stdout)["batch_size"] == 2


def test_loadtest_out_on_a_device_is_one_line_before_any_server_starts():
    result = invoke("loadtest", "--out", "/dev/full", "--requests", "1")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == "error: --out /dev/full: not a folder (a file is in the way); give a folder to " \
                                    "write into"


# ------------------------------------------------------------------------------ two runs, one file
@pytest.mark.slow
def test_a_second_calibration_through_a_symlink_is_refused_while_the_first_runs(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out, link = tmp_path / "a.json", tmp_path / "link-to-a.json"
    link.symlink_to(out)
    first = subprocess.Popen([sys.executable, "-m", "specbatch.cli", "calibrate", "-o", out, "--threads", "1",
                              "--no-stage2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             # SIGINT reaches it even when these tests run in a background job (started ignored)
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "a.json.lock").exists():  # the default grid runs for minutes once locked
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.1)
        second = run_specbatch("calibrate", "-o", link, *TINY_CALIBRATION)
        assert_one_error_line(second, f"--out {link}", "another calibration is writing it", f"pid {first.pid}")
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGINT)
        try:
            first.wait(120)
        except subprocess.TimeoutExpired:  # a loaded machine: the point being measured takes its time
            first.kill()
            first.wait()
