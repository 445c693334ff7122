"""Versioned JSON files: atomic writes and schema-checked reads.

Every perfmodel file carries `"schema": "specbatch.<kind>/<version>"`. Readers refuse a file whose
schema is not the one they understand and say which schema they found and which they expected.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import PerfModelError


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` so that `path` holds either the old file or the complete new one.

    The temporary file lives in the destination directory because `os.replace` is only atomic
    within one filesystem; fsync before the rename so a crash cannot leave an empty file behind.
    """
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        raise PerfModelError(f"{path}: cannot write, directory {directory} does not exist")
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            os.fchmod(file.fileno(), 0o644)  # mkstemp makes 0600; these files are meant to be shared
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Atomic JSON write. NaN and infinity are refused: they are not JSON and other tools choke."""
    write_text_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike, schema_prefix: str) -> dict:
    """Read a JSON object whose `schema` field matches `schema_prefix`.

    `schema_prefix` is either a full schema such as "specbatch.table/1" (the file must carry exactly
    that) or a family ending in "/" such as "specbatch.table/" (any version of that family).
    """
    path = Path(path)
    if not path.is_file():
        raise PerfModelError(f"{path}: no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise PerfModelError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    except UnicodeDecodeError:
        raise PerfModelError(f"{path}: not a UTF-8 text file") from None
    if not isinstance(obj, dict):
        raise PerfModelError(f"{path}: expected a JSON object with schema {schema_prefix!r}, "
                             f"found a JSON {type(obj).__name__}")
    schema = obj.get("schema")
    if schema_prefix.endswith("/"):
        matches = isinstance(schema, str) and schema.startswith(schema_prefix)
    else:
        matches = schema == schema_prefix
    if not matches:
        found = "no schema field" if schema is None else f"schema {schema!r}"
        raise PerfModelError(f"{path}: {found}, expected {schema_prefix!r}")
    return obj


def rounded(value: float | None, significant: int = 7) -> float | None:
    """A float cut to `significant` digits for readable JSON; None for missing or non-finite values
    (JSON has no NaN)."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{significant}g}")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes: how profiles, models and tables name the n-gram file they were made with."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
