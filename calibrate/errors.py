"""The one error class calibrate raises for bad input.

A ValueError subclass so library callers can catch it generically; `cli.py` catches it by name and
prints `error: <message>` with exit code 2. Every message is one line naming the option or file.
"""
from __future__ import annotations


class CalibrationError(ValueError):
    """Bad input to calibration (an option, a model, a prompts or profile file); one-line message."""
