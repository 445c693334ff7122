"""The one atomic writer: complete files or none, mode 0644, nothing but regular files replaced."""
import os
import stat

import pytest

from perfmodel.errors import PerfModelError, SpecbatchError
from perfmodel.jsonio import atomic_output, write_json_atomic, write_text_atomic


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
