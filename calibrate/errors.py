"""The error calibrate raises for bad input (a SpecbatchError: the CLI prints it as one line)."""
from __future__ import annotations

from specbatch.perfmodel.errors import SpecbatchError


class CalibrationError(SpecbatchError):
    """Bad input to calibration (an option, a model, a prompts or profile file); one-line message."""
