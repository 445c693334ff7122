"""The one atomic writer: complete files or none, mode 0644, nothing but regular files replaced."""
import os
import stat

import pytest

from specbatch.perfmodel.errors import PerfModelError, SpecbatchError
from specbatch.perfmodel.jsonio import atomic_output, write_json_atomic, write_text_atomic


def test_writes_shared_mode_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    write_json_atomic(path, {"a": 1})
    assert path.read_text() == '{\n "a": 1\n}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_an_exception_keeps_the_old_file(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(path) as temporary:
            temporary.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_refuses_a_directory_and_a_device(tmp_path):
    with pytest.raises(PerfModelError, match=r"-o .*: a directory"):
        write_text_atomic(tmp_path, "x", "-o")
    with pytest.raises(PerfModelError, match="not a regular file"):
        write_text_atomic("/dev/null", "x", "-o")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_symlink_stays_a_link_and_its_target_is_written(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(SpecbatchError, match="does not exist"):
        write_text_atomic(tmp_path / "nope" / "x.json", "x")


# ---------------------------------------------------------------- writes that never destroy
def test_an_output_that_is_its_own_input_is_refused_whatever_its_spelling(tmp_path, monkeypatch):
    from specbatch.perfmodel.jsonio import check_not_input

    source = tmp_path / "p.json"
    source.write_text("{}")
    (tmp_path / "link.json").symlink_to(source)
    monkeypatch.chdir(tmp_path)
    for output in ("p.json", "./p.json", str(source), "link.json"):
        with pytest.raises(PerfModelError, match="that is the input file"):
            check_not_input(output, ["p.json"], "--output")
    check_not_input("other.json", ["p.json"], "--output")


def test_an_output_folder_with_a_file_in_the_way_is_refused(tmp_path):
    from specbatch.perfmodel.jsonio import writable_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(PerfModelError, match="--out .*file: not a folder"):
        writable_dir(tmp_path / "file", "--out")
    with pytest.raises(PerfModelError, match="is not a folder"):
        writable_dir(tmp_path / "file" / "below", "--out")
    assert writable_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"  # created later


def test_a_second_lock_on_one_output_fails_at_once_naming_the_first(tmp_path):
    from specbatch.perfmodel.jsonio import exclusive_lock

    out = tmp_path / "profile.json"
    with exclusive_lock(out, "--out", "calibration"):
        with pytest.raises(PerfModelError, match=rf"another calibration is writing it \(pid {os.getpid()}"):
            with exclusive_lock(out, "--out", "calibration"):
                pass
    assert list(tmp_path.iterdir()) == []  # the lock file goes with the run
    with exclusive_lock(out):  # and the path is free again
        pass


def test_a_symlink_and_its_target_share_one_lock(tmp_path):
    from specbatch.perfmodel.jsonio import exclusive_lock

    out, link = tmp_path / "a.json", tmp_path / "elsewhere" / "link-to-a.json"
    link.parent.mkdir()
    link.symlink_to(out)  # dangling until a run writes a.json: still the same file
    with exclusive_lock(out, "--out", "calibration"):
        with pytest.raises(PerfModelError, match=r"--out .*link-to-a.json: another calibration is writing it"):
            with exclusive_lock(link, "--out", "calibration"):
                pass
    with exclusive_lock(link, "--out", "calibration"):
        assert (tmp_path / "a.json.lock").is_file()  # beside the file the link resolves to
        with pytest.raises(PerfModelError, match="another calibration is writing it"):
            with exclusive_lock(out, "--out", "calibration"):
                pass


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_on_read_naming_the_field(tmp_path, constant):
    from specbatch.perfmodel.jsonio import read_json

    path = tmp_path / "m.json"
    path.write_text('{"schema": "specbatch.model/1", "roles": {"target": {"roofline": {"bandwidth_GBps": %s}}},'
                    ' "rows": [[1, 2.0], [3, %s]]}' % (constant, constant))
    with pytest.raises(PerfModelError, match=r"m.json: roles.target.roofline.bandwidth_GBps: .* is not a finite"):
        read_json(path, "specbatch.model/1")


def test_a_models_fingerprint_is_its_content_not_its_path(tmp_path):
    from specbatch.perfmodel.jsonio import FULL_HASH_BYTES, directory_fingerprint, model_fingerprint

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"layers": 2}')
        (tmp_path / name / "model.safetensors").write_bytes(b"w" * 100)
    assert directory_fingerprint(tmp_path / "a") == directory_fingerprint(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").write_bytes(b"w" * 99 + b"x")
    assert directory_fingerprint(tmp_path / "a") != directory_fingerprint(tmp_path / "b")
    big = tmp_path / "big.bin"  # sampled above FULL_HASH_BYTES: a change at the end still shows
    with open(big, "wb") as file:
        file.truncate(FULL_HASH_BYTES + 10)
    before = model_fingerprint(b"{}", [big])
    with open(big, "r+b") as file:
        file.seek(FULL_HASH_BYTES + 5)
        file.write(b"\1")
    assert model_fingerprint(b"{}", [big]) != before
