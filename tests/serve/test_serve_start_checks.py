"""What `serve` says at start rather than later: a tokenizer with ids past the model's vocabulary (a warning
naming --target, then a 400 that explains it to a prompt that uses one)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import pytest

from serve_helpers import demo_server


@pytest.fixture(scope="module")
def target_with_an_extra_token(tmp_path_factory):
    """The demo target whose tokenizer has one added token (id 259) past the model's 259-token vocabulary."""
    from specbatch.runtime.assembly import DEMO_TARGET

    target = tmp_path_factory.mktemp("extra") / "demo-extra"
    shutil.copytree(DEMO_TARGET, target)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 259, "content": "<extra>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


def test_a_tokenizer_past_the_vocabulary_is_said_at_start_and_explained_to_the_prompt_that_uses_it(
        target_with_an_extra_token, caplog):
    caplog.set_level(logging.WARNING, logger="specbatch.serve")
    with demo_server(target=str(target_with_an_extra_token), k=0) as server:  # the demo draft's tokenizer differs
        said = [r.getMessage() for r in caplog.records if "its tokenizer gives token id" in r.getMessage()]
        assert said == [f"--target {target_with_an_extra_token}: its tokenizer gives token id 259 (an added token?) "
                        "but the model's vocabulary has 259 tokens; a request whose text gives that token gets a 400"]
        url = f"{server.url}/v1/completions"
        refused = httpx.post(url, json={"model": server.served.name, "prompt": "def f(x): <extra>", "max_tokens": 2})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "prompt" and "gives token id 259, past the model's vocabulary of 259" in \
            error["message"] and "tokenizer has ids its model lacks" in error["message"]
        ids = httpx.post(url, json={"model": server.served.name, "prompt": [1, 259], "max_tokens": 2})
        assert ids.status_code == 400 and ids.json()["error"]["message"] == "token ids must be in [0, 259)"
        assert httpx.post(url, json={"model": server.served.name, "prompt": "def f(x):", "max_tokens": 2,
                                     "temperature": 0}).status_code == 200


def test_a_requests_table_note_is_logged_when_it_happens_not_at_exit(write_table, caplog):
    """`serve --table`: a table whose one context bucket (128 tokens) a short request is outside of notes the
    edge bucket at the request's step, in the server's log then; the CLI's end-of-command notes get nothing."""
    import warnings

    from specbatch.perfmodel.errors import NoteWarning
    from specbatch.serve.server import notes_as_they_come

    caplog.set_level(logging.WARNING, logger="specbatch.serve")
    table = write_table({b: 2 for b in range(1, 5)})
    with warnings.catch_warnings(record=True) as at_exit:  # what the CLI's one_line_errors records for its end
        warnings.simplefilter("default")
        with notes_as_they_come(), demo_server(table=Path(table), k=None, force=True) as server:
            response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                  json={"model": server.served.name, "prompt": "def f(x):", "max_tokens": 3})
            assert response.status_code == 200
            notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note: table: context")]
            assert len(notes) == 1 and "outside the buckets [128, 128]" in notes[0]  # logged while serving
    assert not [w for w in at_exit if issubclass(w.category, NoteWarning)]
