"""Real system faults for the CLI tests: a full disk, a read-only file system, a folder we may not
write, standard output that takes no bytes. Each runs `specbatch` as a subprocess, so the fault is the
operating system's own, never a mock.

The disk and file-system faults need root (a tmpfs or read-only bind mount in a private mount namespace,
invisible outside the command, gone when it exits); permission faults need a user the permissions bind:
as root, the command runs with every capability dropped (`setpriv`), so root's override is gone.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

SPECBATCH = [sys.executable, "-m", "specbatch.cli"]

# $1 seed folder (copied in), $2 the folder that becomes a full disk, $3 where its contents go afterwards
_FULL_DISK = r'''
seed=$1 disk=$2 keep=$3; shift 3
mount -t tmpfs -o size=512k tmpfs "$disk" || exit 97
cp -a "$seed"/. "$disk"/
dd if=/dev/zero of="$disk/.filler" bs=4k count=1000 2>/dev/null
"$@"; rc=$?
rm -f "$disk/.filler"; cp -a "$disk"/. "$keep"/
exit $rc
'''
_READ_ONLY = r'''
folder=$1; shift
mount --bind "$folder" "$folder" && mount -o remount,bind,ro "$folder" || exit 97
"$@"
'''


@lru_cache(maxsize=None)
def _private_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


def needs_private_mounts():
    if not _private_mounts():
        pytest.skip("needs root and `unshare --mount` (a tmpfs or read-only mount private to the command)")


def run_specbatch(*args, cwd: Path | None = None, prefix: list[str] = (), stdout=subprocess.PIPE,
                  timeout_s: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*prefix, *SPECBATCH, *map(str, args)], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE,
                            text=True, timeout=timeout_s, env=env)
    assert result.returncode != 97, f"the fault could not be set up: {result.stderr}"
    return result


def on_full_disk(disk: Path, seed: Path, keep: Path) -> list[str]:
    """Prefix: `disk` is a tmpfs holding a copy of `seed`'s files and nothing free; after the command its
    files (without the filler) are copied to `keep`."""
    needs_private_mounts()
    for folder in (disk, keep):
        folder.mkdir(parents=True, exist_ok=True)
    return ["unshare", "--mount", "sh", "-c", _FULL_DISK, "sh", str(seed), str(disk), str(keep)]


def on_read_only(folder: Path) -> list[str]:
    """Prefix: `folder` is a read-only file system for the command."""
    needs_private_mounts()
    folder.mkdir(parents=True, exist_ok=True)
    return ["unshare", "--mount", "sh", "-c", _READ_ONLY, "sh", str(folder)]


def without_root_override() -> list[str]:
    """Prefix: file permissions bind the command (as root: every capability dropped)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot bind")
    return ["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"]


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2, no traceback, exactly one `error: ` line on stderr naming every fragment."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]
