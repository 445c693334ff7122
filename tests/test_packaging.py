"""The built wheel works as an installed package: built from a copy of the source tree, installed into a fresh
virtual environment and run from another directory, `specbatch generate` finds the bundled demo pair, and
every module comes from that environment, not from the repository.

The fresh environment borrows torch and the other dependencies from the running interpreter's site
directories through a .pth file (nothing is downloaded; a .pth file's own .pth files are not read, so the
repository's editable install does not come along); the wheel itself is installed with --no-deps.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "benchmarks", "docs"}  # source folders that stay out of the wheel
# investigation modules that once sat inside the package; benchmarks/ holds them now
MOVED_OUT = ("specbatch/bench/linear_layout.py", "specbatch/bench/vllm/roundtrip.py",
             "specbatch/bench/vllm/schedule_oracle.py")
pytestmark = pytest.mark.slow


def _source_files() -> list[Path]:
    """What a clean checkout holds (tracked files and untracked ones git does not ignore), relative paths."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        skip = {".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache", "runs"}
        return [path.relative_to(ROOT) for path in ROOT.rglob("*") if path.is_file()
                and not any(part in skip or part.startswith(".venv") or part.endswith(".egg-info")
                            for part in path.relative_to(ROOT).parts)]
    return [Path(name) for name in listed if name and (ROOT / name).is_file()]  # deleted, not yet staged: gone


def _build_wheel(tmp_path: Path, files: list[Path]) -> Path:
    """The wheel of a copy of the source tree: no build/ or egg-info of the working tree can leak into it."""
    source = tmp_path / "source"
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    try:
        import setuptools  # noqa: F401 - present: build with it, offline
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []  # pip fetches the build backend from the package index
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path / "wheel"),
                    str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("specbatch-*.whl")
    return wheel


def _fresh_environment(tmp_path: Path) -> Path:
    """A new virtual environment whose site-packages also sees the running interpreter's site directories.
    Without a pip of its own (seconds saved): the running interpreter's pip installs into it (`--python`)."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    borrowed = [path for path in sys.path if path.endswith(("site-packages", "dist-packages")) and Path(path).is_dir()]
    (Path(site_dir) / "borrowed-dependencies.pth").write_text("".join(f"{path}\n" for path in borrowed))
    return env


def _run(env: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    environ.update(OMP_NUM_THREADS="1", VIRTUAL_ENV=str(env), PATH=f"{env / 'bin'}{os.pathsep}{environ['PATH']}")
    return subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


def test_the_wheel_installs_and_generates_from_another_directory(tmp_path):
    files = _source_files()
    wheel = _build_wheel(tmp_path, files)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"specbatch/{name.as_posix()}" for name in files
               if name.suffix == ".py" and name.parts[0] not in NOT_SHIPPED}
    assert modules - shipped == set(), "source modules missing from the wheel (a package not listed in pyproject?)"
    for data in ("data/models/demo-target/model.safetensors", "data/models/demo-draft/tokenizer.json",
                 "data/models/demo-ngram.safetensors", "data/prompts/heldout.jsonl", "data/prompts/base64.jsonl"):
        assert f"specbatch/{data}" in shipped, data
    # no investigation in the wheel: its modules are exactly the package's sources, none from benchmarks/
    assert {name for name in shipped if name.endswith(".py")} == modules
    assert not any(name.startswith(("specbatch/tests/", "specbatch/benchmarks/", "specbatch/scripts/"))
                   for name in shipped)
    assert not set(MOVED_OUT) & shipped
    assert any(name.parts[0] == "benchmarks" for name in files)  # the check above saw the scripts, and left them out
    top_level = {name.split("/")[0] for name in shipped if not name.startswith("specbatch-")}
    assert top_level == {"specbatch"}  # one installed name: nothing generic (bench, runtime, ...) at the top

    env = _fresh_environment(tmp_path)
    install = _run(env, [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "-q",
                         "--no-deps", "--no-index", str(wheel)], tmp_path)
    assert install.returncode == 0, install.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = _run(env, [str(env / "bin" / "python"), "-c",
                       "import specbatch; from specbatch.calibrate.environment import git_revision; "
                       "from specbatch.runtime.assembly import DEMO_TARGET; "
                       "print(specbatch.__file__); print(DEMO_TARGET); print(git_revision())"], elsewhere)
    assert where.returncode == 0, where.stderr
    package_file, demo_target, revision = where.stdout.split()
    assert Path(package_file).is_relative_to(env) and not Path(package_file).is_relative_to(ROOT)
    assert Path(demo_target).is_relative_to(env) and (Path(demo_target) / "config.json").is_file()
    assert revision == "None"  # an installed package is no git checkout

    result = _run(env, [str(env / "bin" / "specbatch"), "generate", "--prompt", "def f(x):", "--max-new-tokens", "4",
                        "--device", "cpu", "--json"], elsewhere)
    assert result.returncode == 0, result.stderr
    generation = json.loads(result.stdout)
    (output,) = generation["outputs"]
    assert output["prompt"] == "def f(x):" and 1 <= len(output["token_ids"]) <= 4
    assert list(elsewhere.iterdir()) == []  # generate writes nothing where it runs
