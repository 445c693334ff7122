"""Running the `specbatch` CLI in-process, and what a one-line error must look like (shared by the CLI tests)."""
from __future__ import annotations

from typer.testing import CliRunner

from specbatch import cli

runner = CliRunner()


def invoke(*args):
    return runner.invoke(cli.app, [str(a) for a in args])


def assert_one_line_error(result, *fragments: str) -> None:
    """Exit code 2, one `error: ...` line on stderr naming every fragment, nothing on stdout, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    assert "Traceback" not in result.output and result.stdout == ""
    for fragment in fragments:
        assert fragment in message, message
