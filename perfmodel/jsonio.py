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
from typing import Any, Iterable, Iterator

from .errors import PerfModelError, WriteError


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


REPLACE_RULE_HELP = ("An output already there is replaced only with --force, and only when it is the same kind of "
                     "file; a file of another kind is never replaced.")
IMAGE_SIGNATURES = ((b"\x89PNG", "image"), (b"%PDF", "image"), (b"<svg", "image"), (b"<?xml", "image"))


def output_kind(path: str | os.PathLike) -> str | None:
    """What an existing file is, as `check_replace` compares it: a specbatch JSON file's schema family
    ('specbatch.model'), an engine's export ('vllm config', 'trtllm config', 'sglang config'), 'image',
    'csv:<header row>'; None for anything else (notes, a model's weights...)."""
    with open(path, "rb") as file:
        head = file.read(1 << 16)
    for signature, kind in IMAGE_SIGNATURES:
        if head.lstrip().startswith(signature):
            return kind
    try:
        obj = json.loads(Path(path).read_bytes()) if head.lstrip().startswith(b"{") else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict):
        if isinstance(obj.get("schema"), str) and obj["schema"].startswith("specbatch."):
            return obj["schema"].split("/")[0]
        if "num_speculative_tokens" in obj:
            return "vllm config"
        if "decoding_type" in obj:
            return "trtllm config"
        if "--speculative-adaptive" in (obj.get("server_args") or []):
            return "sglang config"
        return None
    first_line = head.split(b"\n", 1)[0].strip()
    if b"," in first_line and first_line.replace(b"_", b"").replace(b",", b"").isalnum():
        return "csv:" + first_line.decode()
    return None


def describe_kind(kind: str | None) -> str:
    if kind is None:
        return "a file specbatch did not write"
    if kind.startswith("csv:"):
        return f"a CSV file with columns {kind[4:64]}{'...' if len(kind) > 64 else ''}"
    return {"image": "an image", "vllm config": "a vLLM speculative config",
            "trtllm config": "a TensorRT-LLM speculative config",
            "sglang config": "an SGLang adaptive speculative config"}.get(kind, f"a {kind} file")


def check_replace(path: str | os.PathLike, kind: str, force: bool, option: str = "--output",
                  other_way: str = "") -> None:
    """The one rule for every output (REPLACE_RULE_HELP): nothing there, write; the same kind there, replace
    it only with `force`; anything else there, refuse. Called before any work, so nothing is lost.
    `other_way`: what else the command can do with the file (calibrate: '--resume to continue it')."""
    path = writable_path(path, option)
    if not path.exists():
        return
    found = output_kind(path)
    empty = path.stat().st_size == 0  # a placeholder (touch, mktemp) holds nothing to lose: as the same kind
    if found != kind and not empty:
        raise PerfModelError(f"{option} {path}: {describe_kind(found)} is there, not {describe_kind(kind)}; it is "
                             "never replaced: remove it or choose another path")
    if not force:
        also = f", {other_way}," if other_way else ""
        what = "an empty file" if empty else describe_kind(kind)
        raise PerfModelError(f"{option} {path}: {what} is already there; pass --force to replace it"
                             f"{also} or give another path")


def check_replace_in(folder: str | os.PathLike, kinds: dict[str, str], force: bool, option: str = "--out") -> None:
    """`check_replace` for each file a command writes into `folder` (name -> kind)."""
    folder = Path(folder)
    if folder.is_dir():
        for name, kind in kinds.items():
            if (folder / name).exists():
                check_replace(folder / name, kind, force, option)


def check_not_input(output: str | os.PathLike, inputs: Iterable[str | os.PathLike], option: str = "--output") -> None:
    """Refuse an output that is one of the command's own inputs (`fit p.json -o p.json`): the write would
    replace the file being read. Compared as files (symlinks, `./p.json` and `p.json` are one file)."""
    output = Path(output)
    for source in inputs:
        source = Path(source)
        same = output.resolve() == source.resolve()
        if not same and output.exists() and source.exists():
            same = os.path.samefile(output, source)
        if same:
            raise PerfModelError(f"{option} {output}: that is the input file {source}; give another output path")


def writable_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """A folder outputs will be written into, checked before any measuring: it may exist (a folder) or
    not yet (it is created later); anything else there (a file, a device node) is refused."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise PerfModelError(f"{option} {path}: not a folder (a file is in the way); give a folder to write into")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise PerfModelError(f"{option} {path}: cannot create it, {parent} is not a folder")
    nearest = path if path.exists() else parent
    if nearest is not None and not os.access(nearest, os.W_OK | os.X_OK):
        raise WriteError(f"{_named(option, path)}: cannot write into {nearest} (Permission denied)")
    return path


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, option: str = "--out", what: str = "run") -> Iterator[None]:
    """Hold an exclusive, non-blocking lock on `path` for the block: `<path>.lock` beside it, holding the
    pid of the run that writes `path`. A second run on the same path fails at once with a one-line error
    naming the first (two runs writing one profile would each report success, and the last one wins).
    The lock sits beside the file `path` resolves to, so a symlink to it and the file itself are one path.
    The lock file is removed on exit; a lock file whose inode changed under us (removed by the holder
    between our open and our lock) is opened again, so two runs never hold locks on different inodes."""
    import fcntl

    resolved = Path(path).resolve()  # a link and its target: one lock
    lock_path = resolved.with_name(resolved.name + ".lock")
    while True:
        try:
            handle = open(lock_path, "a+")
        except OSError as error:  # e.g. a folder we may not write into
            raise WriteError(f"{_named(option, path)}: cannot create the lock file {lock_path} "
                             f"({os_reason(error)})") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown pid"
            handle.close()
            raise PerfModelError(f"{option} {path}: another {what} is writing it ({holder}, lock {lock_path}); "
                                 f"wait for it or choose another path") from None
        if os.path.exists(lock_path) and os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()
    try:
        try:
            os.ftruncate(handle.fileno(), 0)  # unbuffered: nothing left to fail again when the handle closes
            os.write(handle.fileno(), f"pid {os.getpid()}".encode())
        except OSError as error:  # a full disk: the run could not write its output either
            raise WriteError(f"{_named(option, path)}: cannot write the lock file {lock_path} "
                             f"({os_reason(error)})") from None
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        handle.close()


def _named(option: str, path: str | os.PathLike) -> str:
    """'--out x.json' for an option, plain 'x.json' for a library write without one."""
    return f"{option} {path}" if option.startswith("-") else str(path)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, option: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an exception, the temporary
    file becomes `path` (mode 0644, fsynced, renamed), so `path` holds either the old file or the
    complete new one. On an exception the temporary file is removed and `path` is untouched; an OSError
    (disk full, read-only file system, permission denied) becomes a one-line WriteError naming `path`
    and the system's reason.

    The one way specbatch writes a file. The temporary file lives in the destination directory because
    `os.replace` is only atomic within one filesystem; fsync before the rename so a crash cannot leave
    an empty file behind.
    """
    target = writable_path(path, option)
    existed = target.exists()
    temporary = None
    try:
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(handle)
        yield Path(temporary)
        os.chmod(temporary, 0o644)  # mkstemp makes 0600; these files are meant to be shared
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, target)
    except OSError as error:
        kept = "the existing file is unchanged" if existed else "nothing was written"
        raise WriteError(f"{_named(option, path)}: cannot write ({os_reason(error)}); {kept}") from None
    finally:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


def os_reason(error: OSError) -> str:
    """The system's words for an OSError ('No space left on device'), without the errno and path."""
    return error.strerror or str(error)


def make_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """Create the output folder `path` (and its parents); a file in the way or a folder the system
    will not create is a one-line error."""
    path = writable_dir(path, option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise WriteError(f"{_named(option, path)}: cannot create the folder ({os_reason(error)})") from None
    return path


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
    if path.is_dir():
        raise PerfModelError(f"{path}: a directory, expected a {schema_prefix.rstrip('/')} JSON file")
    if not path.is_file():
        raise PerfModelError(f"{path}: no such file")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
        _refuse_non_finite(obj, f"{path}:")
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


def _refuse_non_finite(obj: Any, where: str) -> None:
    """Python's JSON reader accepts NaN and Infinity, which are not JSON and poison every number computed
    from them (a NaN coefficient ranks every k equal): refuse them, naming the field."""
    if isinstance(obj, float) and not math.isfinite(obj):
        raise PerfModelError(f"{where}: {obj!r} is not a finite number (NaN and Infinity are not JSON)")
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list, float)):
            field = f"[{key}]" if isinstance(key, int) else (f" {key}" if where.endswith(":") else f".{key}")
            _refuse_non_finite(value, f"{where}{field}")


def rounded(value: float | None, significant: int = 7) -> float | None:
    """A float cut to `significant` digits for readable JSON; None for missing or non-finite values
    (JSON has no NaN)."""
    if value is None or not math.isfinite(value):
        return None
    return float(f"{value:.{significant}g}")


FULL_HASH_BYTES = 64 << 20  # weight files up to this size are hashed whole
SAMPLE_BYTES = 1 << 20  # larger ones: their header and three 1 MiB samples (start, middle, end)


def model_fingerprint(config: bytes, weight_files: Iterable[str | os.PathLike] = ()) -> str:
    """What a model IS, whatever its path is spelled: sha256 over its config (the bytes of config.json, or
    of a preset's canonical JSON) and, per weight file, its name, size and contents. Files above
    FULL_HASH_BYTES are sampled (first, middle and last MiB) so a 14 GB checkpoint costs milliseconds, not
    a minute; a fine-tune of the same shape still changes the sampled bytes. No weight files: random
    weights of that shape."""
    digest = hashlib.sha256(config)
    for weight_file in sorted(Path(f) for f in weight_files):
        size = weight_file.stat().st_size
        digest.update(f"{weight_file.name}:{size}".encode())
        with open(weight_file, "rb") as file:
            if size <= FULL_HASH_BYTES:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
                continue
            for offset in (0, size // 2, size - SAMPLE_BYTES):
                file.seek(offset)
                digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()


def directory_fingerprint(directory: str | os.PathLike) -> str:
    """`model_fingerprint` of a Hugging Face model directory: config.json and every weight file in it."""
    directory = Path(directory)
    weights = [f for f in directory.iterdir() if f.is_file() and f.name.endswith((".safetensors", ".bin"))]
    return model_fingerprint((directory / "config.json").read_bytes(), weights)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes: how profiles, models and tables name the n-gram file they were made with."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
