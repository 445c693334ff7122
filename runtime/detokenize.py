"""The text of a growing token sequence, decoded a few tokens at a time.

A serving row's text grows by a few tokens a step; decoding the whole sequence every step costs time in
its length. Here each step decodes only the tokens since the last certain point, with the tokens before
that point (back to the previous one) as context: decoders treat a sequence's start specially (a
SentencePiece decoder strips its first space), so the new text is the context-plus-new decode less the
context's own. Text that ends inside a multi-byte character (U+FFFD) waits for the next tokens.

Assumes the decoder is concatenative at character boundaries given that context (byte-level BPE and
SentencePiece decoders are); where it is not, or a sequence is cut below what was read, that step
decodes the whole sequence.
"""
from __future__ import annotations

from typing import Callable

INCOMPLETE = "\ufffd"  # what a decoder gives for a multi-byte character cut short


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""  # the text of tokens[:read]: certain, it never changes
        self._context = 0  # where the context of the next decode starts: the previous certain point
        self._read = 0

    def extend(self, tokens: list[int], final: bool = False) -> str:
        """The text of `tokens` (the sequence so far: the last call's, extended) as far as it is certain;
        with `final`, all of it, a cut character included. Only slices of it are read (no copy per step)."""
        if len(tokens) < self._read:  # cut below what was read: start again
            self.text, self._context, self._read = "", 0, 0
        if len(tokens) == self._read:
            return self.text
        context = self.decode(tokens[self._context:self._read]) if self._read > self._context else ""
        window = self.decode(tokens[self._context:])
        if not final and window.endswith(INCOMPLETE):
            # a character cut short: wait for it (a byte-fallback decoder turns the whole run of byte pieces
            # it belongs to into U+FFFD until it is complete, so nothing past the certain point is shown)
            return self.text
        if window.startswith(context):
            self.text += window[len(context):]
        else:  # not concatenative here: this step decodes the whole sequence
            self.text = self.decode(tokens)
        self._context, self._read = self._read, len(tokens)
        return self.text
