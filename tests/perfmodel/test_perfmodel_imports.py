"""perfmodel never imports torch: a table must be computable on any laptop from a profile measured elsewhere."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_perfmodel_imports_no_torch():
    package = ROOT / "perfmodel"
    modules = sorted(".".join(path.relative_to(package).with_suffix("").parts).removesuffix(".__init__")
                     for path in package.rglob("*.py") if path != package / "__init__.py")
    assert {"latency", "model", "table", "strategy", "profile", "profile.insitu"} <= set(modules)
    code = ("import importlib, sys; "
            f"[importlib.import_module('specbatch.perfmodel.' + name) for name in {modules!r}]; "
            "assert 'torch' not in sys.modules, 'perfmodel imported torch'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cli_help_and_perfmodel_commands_import_no_torch():
    """The perfmodel commands import their modules lazily; running one must not drag torch in."""
    code = ("import sys; from typer.testing import CliRunner; from specbatch import cli; "
            "r = CliRunner().invoke(cli.app, ['query', '--table', 'missing.json', '--batch-size', '1']); "
            "assert r.exit_code == 2, r.output; "
            "assert 'torch' not in sys.modules, 'a perfmodel command imported torch'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
