"""The one error class perfmodel raises for bad input.

It subclasses ValueError so library callers can catch it generically; the CLI catches it by name and
prints `error: <message>` with exit code 2. Every message is one line that names the file or option
and says what is wrong with it.
"""
from __future__ import annotations


class PerfModelError(ValueError):
    """Bad input to the performance model (a file, an option, a value); the message is one line."""
