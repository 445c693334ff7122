"""Strict readers of JSON fields: each takes the enclosing object, the key and `where` (the file and the
path to the object) so that an error names exactly the field at fault
(`profile.json: timings[3].median_ms: expected a number, found 'fast'`).

Shared by the file contracts (`perfmodel.profile` and its sections).
"""
from __future__ import annotations

import math
from typing import Any

from .errors import PerfModelError

ROLES = ("target", "draft")  # the two model roles every file contract names


def at(where: str, key: str) -> str:
    """'profile.json:' + 'grid' -> 'profile.json: grid'; 'profile.json: grid' + 'max_k' -> '... grid.max_k'."""
    return f"{where} {key}" if where.endswith(":") else f"{where}.{key}"


# what a JSON value is, in JSON's words (a file's reader never saw Python's 'NoneType' or 'dict')
_JSON_KINDS = {type(None): "null", bool: "true or false", int: "a number", float: "a number", str: "a string",
               list: "a list", dict: "an object"}


def json_kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def get(obj: dict, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where.rstrip(':')}: expected a JSON object, found {json_kind(obj)}")
    if key not in obj:
        raise PerfModelError(f"{at(where, key)}: missing")
    return obj[key]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(obj: dict, key: str, where: str, minimum: int | None = None, nullable: bool = False) -> int | None:
    value = get(obj, key, where)
    if value is None and nullable:
        return None
    if not is_int(value):
        raise PerfModelError(f"{at(where, key)}: expected an integer, found {value!r}")
    if minimum is not None and value < minimum:
        raise PerfModelError(f"{at(where, key)}: must be >= {minimum}, found {value}")
    return value


def number(obj: dict, key: str, where: str, minimum: float | None = None, nullable: bool = False) -> float | None:
    value = get(obj, key, where)
    if value is None and nullable:
        return None
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise PerfModelError(f"{at(where, key)}: expected a number, found {value!r}")
    if minimum is not None and value < minimum:
        raise PerfModelError(f"{at(where, key)}: must be >= {minimum}, found {value}")
    return float(value)


# A measured time outside these bounds is not a measurement (a pass of under a nanosecond or over a day);
# inside them every fit's arithmetic (relative weights, logs, squares) stays finite.
MIN_MEASURED_MS, MAX_MEASURED_MS = 1e-6, 1e8


def duration_ms(obj: dict, key: str, where: str, nullable: bool = False, allow_zero: bool = False) -> float | None:
    """A measured time in milliseconds: finite and within the bounds above (0 too with `allow_zero`)."""
    value = number(obj, key, where, nullable=nullable)
    if value is None or (allow_zero and value == 0):
        return value
    if not MIN_MEASURED_MS <= value <= MAX_MEASURED_MS:
        raise PerfModelError(f"{at(where, key)}: expected a measured time in ms between {MIN_MEASURED_MS:g} and "
                             f"{MAX_MEASURED_MS:g}, found {value!r}")
    return value


def string(obj: dict, key: str, where: str, choices: tuple[str, ...] | None = None,
           nullable: bool = False) -> str | None:
    value = get(obj, key, where)
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise PerfModelError(f"{at(where, key)}: expected a string, found {value!r}")
    if choices is not None and value not in choices:
        raise PerfModelError(f"{at(where, key)}: {value!r} is not one of {', '.join(choices)}")
    return value


def boolean(obj: dict, key: str, where: str) -> bool:
    value = get(obj, key, where)
    if not isinstance(value, bool):
        raise PerfModelError(f"{at(where, key)}: expected true or false, found {value!r}")
    return value


def listed(obj: dict, key: str, where: str, nullable: bool = False) -> list | None:
    value = get(obj, key, where)
    if value is None and nullable:
        return None
    if not isinstance(value, list):
        raise PerfModelError(f"{at(where, key)}: expected a list, found {json_kind(value)}")
    return value


def int_list(obj: dict, key: str, where: str, minimum: int, nullable: bool = False) -> tuple[int, ...] | None:
    values = listed(obj, key, where, nullable)
    if values is None:
        return None
    for index, value in enumerate(values):
        if not is_int(value) or value < minimum:
            raise PerfModelError(f"{at(where, key)}[{index}]: expected an integer >= {minimum}, found {value!r}")
    return tuple(values)


def number_list(obj: dict, key: str, where: str, nullable: bool = False) -> tuple[float, ...] | None:
    values = listed(obj, key, where, nullable)
    if values is None:
        return None
    for index, value in enumerate(values):
        if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise PerfModelError(f"{at(where, key)}[{index}]: expected a number, found {value!r}")
    return tuple(float(value) for value in values)


def json_object(obj: dict, key: str, where: str) -> dict:
    value = get(obj, key, where)
    if not isinstance(value, dict):
        raise PerfModelError(f"{at(where, key)}: expected a JSON object, found {value!r}")
    return value


# a dataclass field's annotation -> how its JSON value is read (`record`)
_READERS = {"int": lambda obj, key, where: integer(obj, key, where),
            "float": lambda obj, key, where: number(obj, key, where),
            "float | None": lambda obj, key, where: number(obj, key, where, nullable=True),
            "int | None": lambda obj, key, where: integer(obj, key, where, nullable=True),
            "str": lambda obj, key, where: string(obj, key, where)}


def record(cls, obj: Any, where: str):
    """A flat dataclass of ints, floats and strings from its JSON object, each field read by its annotation."""
    from dataclasses import fields

    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected a JSON object, found {obj!r}")
    return cls(**{field.name: _READERS[str(field.type)](obj, field.name, where) for field in fields(cls)})
