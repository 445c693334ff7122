"""Incremental text against the oracle, the whole sequence decoded at once: for the demo pair's byte-level
tokenizer and a SentencePiece-style decoder (leading-space strip, byte fallback), over random token
sequences fed in random chunks (characters cut between chunks), every certain text is a prefix of the whole
decode and the final one is it."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from specbatch.runtime.assembly import DEMO_TARGET
from specbatch.runtime.checkpoint import load_tokenizer
from specbatch.runtime.detokenize import IncrementalText


def sentencepiece_like() -> Tokenizer:
    """Pieces with the '▁' space marker and <0xNN> byte pieces, decoded as Llama-2's tokenizer decodes."""
    pieces = ["<unk>", "▁", "▁the", "▁a", "b", "c", "é", "▁é", "."] + [f"<0x{i:02X}>" for i in range(256)]
    tokenizer = Tokenizer(models.WordLevel({piece: i for i, piece in enumerate(pieces)}, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def demo_tokens(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 40))]


def sentencepiece_tokens(rng: random.Random, vocab: int) -> list[int]:
    """Pieces, and valid characters of 1-4 UTF-8 bytes spelt as byte pieces: byte fallback decodes a run of
    byte pieces as one (an invalid run becomes one U+FFFD per byte, which no decoder can stream)."""
    tokens = []
    for _ in range(rng.randrange(1, 15)):
        if rng.random() < 0.5:
            tokens.append(rng.randrange(1, 9))
        else:
            character = chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0x800),
                                        rng.randrange(0x800, 0xD800), rng.randrange(0x10000, 0x10FFFF)]))
            tokens += [9 + byte for byte in character.encode()]
    return tokens


def decoders_under_test():
    demo = load_tokenizer(DEMO_TARGET)
    spm = sentencepiece_like()
    return {"demo byte-level": (demo.decode, demo.vocab_size, demo_tokens),
            "sentencepiece-like": (lambda ids: spm.decode(ids, skip_special_tokens=False), spm.get_vocab_size(),
                                   sentencepiece_tokens)}


@pytest.mark.parametrize("name", ["demo byte-level", "sentencepiece-like"])
def test_incremental_text_is_the_whole_decode(name):
    decode, vocab, sequence = decoders_under_test()[name]
    rng = random.Random(7)
    for _ in range(200):
        tokens = sequence(rng, vocab)
        whole = decode(tokens)
        text, seen, fed = IncrementalText(decode), "", 0
        while fed < len(tokens):
            fed = min(len(tokens), fed + rng.randrange(1, 6))
            current = text.extend(tokens[:fed], final=fed == len(tokens))
            assert current.startswith(seen) and whole.startswith(current.rstrip("\ufffd")), (tokens, fed)
            seen = current
        assert seen == whole, tokens


def test_a_cut_below_what_was_read_decodes_again():
    decode, vocab, _ = decoders_under_test()["demo byte-level"]
    tokens = [random.Random(3).randrange(1, vocab) for _ in range(12)]
    text = IncrementalText(decode)
    text.extend(tokens)
    assert text.extend(tokens[:5], final=True) == decode(tokens[:5])


def test_each_step_decodes_a_few_tokens_not_the_whole_sequence():
    """A row growing a token a step: the whole-sequence decode reads 1 + 2 + ... + n tokens; this reads
    each token a bounded number of times (in its step's window, then as the next step's context)."""
    decode, vocab, _ = decoders_under_test()["demo byte-level"]
    decoded = []
    text = IncrementalText(lambda ids: decoded.append(len(ids)) or decode(ids))
    tokens = [32 + i % 90 for i in range(200)]  # printable: every step's text is certain
    for n in range(1, len(tokens) + 1):
        text.extend(tokens[:n])
    assert text.text == decode(tokens)
    assert sum(decoded) <= 3 * len(tokens) < len(tokens) * (len(tokens) + 1) // 2
