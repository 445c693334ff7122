"""The runtime's error for input a generation cannot run (raised by the generator and the drafters)."""
from __future__ import annotations

from specbatch.perfmodel.errors import SpecbatchError


class GenerationError(SpecbatchError):
    """Input the generator cannot run (prompt too long, k too large, mismatched vocabularies...)."""
