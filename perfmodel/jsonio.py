"""Versioned JSON files: atomic writes and schema-checked reads.

Every perfmodel file carries `"schema": "specbatch.<kind>/<version>"`. Readers refuse a file whose
schema is not the one they understand and say which schema they found and which they expected.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .errors import PerfModelError


def writable_path(path: str | os.PathLike, option: str = "output") -> Path:
    """The regular file a write to `path` should replace: a symlink is followed (the link stays a link),
    a path that exists but is not a regular file (a directory, /dev/null, a FIFO) is refused, and so is
    one whose folder does not exist. `option` names the path in the one-line error."""
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file"
        raise PerfModelError(f"{option} {path}: {kind}; give the path of a file to write")
    if not target.parent.is_dir():
        raise PerfModelError(f"{option} {path}: cannot write, directory {target.parent} does not exist")
    return target


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, option: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an exception, the temporary
    file becomes `path` (mode 0644, fsynced, renamed), so `path` holds either the old file or the
    complete new one. On an exception the temporary file is removed and `path` is untouched.

    The one way specbatch writes a file. The temporary file lives in the destination directory because
    `os.replace` is only atomic within one filesystem; fsync before the rename so a crash cannot leave
    an empty file behind.
    """
    target = writable_path(path, option)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(handle)
    try:
        yield Path(temporary)
        os.chmod(temporary, 0o644)  # mkstemp makes 0600; these files are meant to be shared
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, target)
    finally:
        Path(temporary).unlink(missing_ok=True)


def write_bytes_atomic(path: str | os.PathLike, data: bytes, option: str = "output") -> None:
    """Atomic write of `data` (see `atomic_output`)."""
    with atomic_output(path, option) as temporary:
        temporary.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str, option: str = "output") -> None:
    """Atomic write of UTF-8 `text` (see `atomic_output`)."""
    write_bytes_atomic(path, text.encode("utf-8"), option)


def write_json_atomic(path: str | os.PathLike, obj: Any, option: str = "output") -> None:
    """Atomic JSON write. NaN and infinity are refused: they are not JSON and other tools choke."""
    write_text_atomic(path, json.dumps(obj, indent=1, allow_nan=False) + "\n", option)


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
