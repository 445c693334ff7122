"""`serve`'s policy options are refused in one line before anything loads (the messages are the oracle)."""
from __future__ import annotations

from pathlib import Path

import pytest

from specbatch.serve.server import ServeError, ServeOptions, choose_policy

TARGET = Path(__file__).resolve().parents[2] / "data" / "models" / "demo-target"


@pytest.mark.parametrize("options, message", [
    (ServeOptions(k=2, table=Path("t.json")), "mutually exclusive"),
    (ServeOptions(k=-1), "--k must be >= 0"),
])
def test_policy_options_are_refused_in_one_line(options, message):
    with pytest.raises(ServeError, match=message) as refused:
        choose_policy(options, TARGET, None, "cpu", 1)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "error: --port must be in [0, 65535], got 99999"),
    (["--port", "-1"], "error: --port must be in [0, 65535], got -1"),
    (["--max-batch-size", "0"], "error: --max-batch-size must be >= 1, got 0"),
    (["--profile", "/dev/null"], "error: --profile /dev/null: not a regular file; give the path of a file to write"),
    (["--drain-s", "nan"], "error: --drain-s must be >= 0 seconds, got nan"),
    (["--max-model-len", "1"], "error: --max-model-len must be >= 2 (a prompt token and a generated one) and below "
                               "the models' context, got 1"),
    (["--host", "999.1.1.1"], "error: --host 999.1.1.1: not an IP address (IPv4: four numbers in [0, 255] like "
                              "127.0.0.1; IPv6: like ::1)"),
    (["--host", "1.2.3"], "error: --host 1.2.3: not an IP address (IPv4: four numbers in [0, 255] like 127.0.0.1; "
                          "IPv6: like ::1)"),
    (["--host", "::g"], "error: --host ::g: not an IP address (IPv4: four numbers in [0, 255] like 127.0.0.1; IPv6: "
                        "like ::1)"),
    # TEST-NET-1 (RFC 5737): an address no machine of ours has
    (["--host", "192.0.2.1", "--port", "0"], "error: --host 192.0.2.1: cannot be bound here (Cannot assign requested "
                                             "address); give an address of this machine, or 0.0.0.0 for all of them"),
])
def test_serve_options_are_one_line_before_anything_loads(args, message, monkeypatch):
    from specbatch.serve import server
    from cli_helpers import invoke

    monkeypatch.setattr(server, "build", lambda options: pytest.fail("serve built a server before checking options"))
    result = invoke("serve", *args)
    assert result.exit_code == 2 and result.stderr.strip() == message, result.output


def test_a_port_in_use_is_one_line_before_anything_loads(monkeypatch):
    import socket

    from specbatch.serve import server
    from cli_helpers import invoke

    monkeypatch.setattr(server, "build", lambda options: pytest.fail("serve built a server before checking its port"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke("serve", "--port", port)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --port {port}: already in use on 127.0.0.1 (another server?); give a " \
                                    "free port"


def test_a_table_made_for_another_pair_is_refused_unless_forced(tmp_path, write_table):
    import json

    from specbatch.perfmodel.errors import UsageError
    from specbatch.runtime.assembly import DEMO_DRAFT
    from specbatch.runtime.policy import TableK
    from specbatch.serve.server import build

    path = tmp_path / "other-pair.json"
    table = json.loads(open(write_table({1: 2, 2: 1})).read())
    path.write_text(json.dumps(table | {"target": "/models/opt-6.7b", "draft": "/models/opt-125m",
                                        "fingerprints": {"target": "a" * 64, "draft": "b" * 64}}))
    expected = (rf"--table {path} was made for another pair: target /models/opt-6.7b \(aaaaaaaaaaaa\) there, "
                r".*demo-target \(.*\) here; .* pass --force")
    with pytest.raises(UsageError, match=expected) as error:
        choose_policy(ServeOptions(table=path), TARGET, DEMO_DRAFT, "cpu", 1)
    assert "\n" not in str(error.value)
    runner, _ = build(ServeOptions(table=path, force=True, max_batch_size=2))
    assert isinstance(runner.engine.policy, TableK)
