"""The `composition` section of a profile: pass times composed from published per-operation timings.

A calibrated profile times whole passes; an imported one (`calibrate --from-vidur`) adds up per-operation
timings someone else measured. The section says where they came from and what each pass time is made of:
what the source measured, what was estimated (and how), and what is left out, so that whoever reads a
table made from it knows which costs it never saw. Profiles without the section mean "timed whole here".
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import PerfModelError
from ..fields import at, get, integer, string


@dataclass(frozen=True)
class SourceFile:
    path: str  # as read (absolute)
    sha256: str


@dataclass(frozen=True)
class Composition:
    source: str  # what produced the per-operation timings, e.g. "vidur"
    files: tuple[SourceFile, ...]
    measured: tuple[str, ...]  # the parts of a pass the source timed
    estimated: tuple[str, ...]  # the parts estimated here, each with how
    left_out: tuple[str, ...]  # the parts no row contains
    padded_rows: int  # rows whose token count the source did not profile (linear operations read at the next one)

    def summary(self) -> str:
        """One line for `fit`, `table` and `query`."""
        return (f"pass times composed from {self.source}'s per-operation timings, not timed whole: "
                f"left out {'; '.join(self.left_out) or 'nothing'}")

    def to_json(self) -> dict:
        return {"source": self.source, "files": [{"path": f.path, "sha256": f.sha256} for f in self.files],
                "measured": list(self.measured), "estimated": list(self.estimated), "left_out": list(self.left_out),
                "padded_rows": self.padded_rows}


def _strings(obj: dict, key: str, where: str) -> tuple[str, ...]:
    values = get(obj, key, where)
    if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
        raise PerfModelError(f"{at(where, key)}: expected a list of strings")
    return tuple(values)


def composition_from_json(obj: dict, where: str) -> Composition:
    files = get(obj, "files", where)
    if not isinstance(files, list) or not files:
        raise PerfModelError(f"{at(where, 'files')}: expected a non-empty list of {{path, sha256}}")
    return Composition(
        source=string(obj, "source", where),
        files=tuple(SourceFile(string(f, "path", f"{at(where, 'files')}[{i}]"),
                               string(f, "sha256", f"{at(where, 'files')}[{i}]")) for i, f in enumerate(files)),
        measured=_strings(obj, "measured", where), estimated=_strings(obj, "estimated", where),
        left_out=_strings(obj, "left_out", where), padded_rows=integer(obj, "padded_rows", where, minimum=0))
