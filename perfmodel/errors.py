"""The project's error classes for bad input: one base, one subclass per stage.

Every library error that means "the user gave something we cannot use" derives from `SpecbatchError`,
so the CLI catches that one class and prints `error: <message>` with exit code 2, never a traceback.
The base lives here because perfmodel is the bottom layer (no torch): calibrate, runtime, bench and the
CLI all import it. `SpecbatchError` subclasses ValueError so library callers can catch it generically.
Every message is one line that names the file or option and says what is wrong with it.
"""
from __future__ import annotations


class SpecbatchError(ValueError):
    """Bad input anywhere in specbatch (a file, an option, a value); the message is one line."""


class PerfModelError(SpecbatchError):
    """Bad input to the performance model (a profile, model or table file, an option, a value)."""


class UsageError(SpecbatchError):
    """A bad command-line option or combination of options, found by whichever layer owns the value."""


class NoteWarning(UserWarning):
    """Something the user should know that is no error; the CLI prints it as one `note:` line."""


class WriteError(SpecbatchError):
    """A file or folder the operating system would not let us write (disk full, read-only, permission
    denied); the message names the path and the system's reason."""
