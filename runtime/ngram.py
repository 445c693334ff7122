"""A Katz backoff trigram model over token ids: the cheapest draft, the "second stage" of staged
speculative decoding (Spector & Ré 2023), which proposes tokens for the draft model to check.

    p(w | u, v) = p*(w | u, v)  if the trigram (u, v, w) was seen, else beta(u, v) * p(w | v)
    p(w | v)    = p*(w | v)     if the bigram was seen,            else beta(v) * p(w)
    p(w)        = (c(w) + 1) / (N + V)   (add-one: every token has p > 0)

p* = c* / c(ctx) with Good-Turing discounts for counts <= 5 (Katz 1987), or absolute discounting
D = n_1 / (n_1 + 2 n_2) (Ney et al. 1994) for an order where Good-Turing misbehaves; beta hands the
discounted mass to unseen tokens in proportion to the lower order. An optional cutoff drops rare trigrams
after discounting. Storage is sparse (CSR rows per bigram and trigram context), so a 128k vocabulary fits.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from specbatch.perfmodel.errors import SpecbatchError
from specbatch.perfmodel.jsonio import atomic_output

from .config import check_vocabulary

SCHEMA = "specbatch.ngram/1"
GOOD_TURING_MAX_COUNT = 5  # Katz's k: counts above are taken as reliable and not discounted
TOP_RANKS = 8  # R: ranked next tokens precomputed per context for top_tokens
_ARRAYS = {  # name -> dtype in the file; each is (length,) with lengths checked in `load`
    "unigram_prob": torch.float32, "bigram_ptr": torch.int64, "bigram_token": torch.int32,
    "bigram_prob": torch.float32, "bigram_backoff": torch.float32, "trigram_context": torch.int64,
    "trigram_ptr": torch.int64, "trigram_token": torch.int32, "trigram_prob": torch.float32,
    "trigram_backoff": torch.float32,
}


class NGramError(SpecbatchError):
    """An n-gram file or option the runtime cannot use; the message names it and the problem."""


def tokenizer_fingerprint(path) -> str:
    """sha256 of a tokenizer.json's vocabulary (sorted (token, id) pairs, added tokens included): two
    files that differ only in formatting or in non-vocabulary settings agree."""
    from tokenizers import Tokenizer

    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as error:  # tokenizers raises a bare Exception subclass
        raise NGramError(f"{path}: not a readable tokenizer.json ({error})") from None
    return hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()


def discounted_counts(counts: np.ndarray) -> tuple[np.ndarray, str]:
    """c* for each n-gram count of one order, and a description of the method used (see module doc)."""
    n = np.bincount(counts, minlength=GOOD_TURING_MAX_COUNT + 2)[: GOOD_TURING_MAX_COUNT + 2].astype(np.float64)
    r = np.arange(1, GOOD_TURING_MAX_COUNT + 1)
    if np.all(n[r] > 0):
        tail = (GOOD_TURING_MAX_COUNT + 1) * n[GOOD_TURING_MAX_COUNT + 1] / n[1]
        with np.errstate(divide="ignore", invalid="ignore"):  # tail = 1: inf/nan, rejected below
            ratio = ((r + 1) * n[r + 1] / (r * n[r]) - tail) / (1 - tail)  # d_r, r = 1..5
        if np.all((ratio > 0) & (ratio <= 1)):
            d = np.ones(len(n))
            d[r] = ratio
            scale = np.where(counts <= GOOD_TURING_MAX_COUNT, d[np.minimum(counts, len(n) - 1)], 1.0)
            return counts * scale, "good-turing d_1..d_5 = " + ", ".join(f"{x:.4f}" for x in ratio)
    absolute = n[1] / (n[1] + 2 * n[2]) if n[1] > 0 and n[2] > 0 else 0.5
    return counts - absolute, f"absolute D = {absolute:.4f}"


def _ranking_keys(probs: torch.Tensor) -> torch.Tensor:
    """int64 keys whose descending order is: larger probability first, then smaller token id. Positive
    float32 bit patterns order like the floats, so the keys are exact and never tie."""
    vocab = probs.shape[-1]
    shift = max(1, (vocab - 1).bit_length())
    ids = torch.arange(vocab, device=probs.device)
    return (probs.view(torch.int32).to(torch.int64) << shift) + (vocab - 1 - ids)


def _row_pointers(row_of_entry: np.ndarray, num_rows: int) -> np.ndarray:
    """CSR row pointers (num_rows + 1,) for entries sorted by row."""
    return np.concatenate([[0], np.cumsum(np.bincount(row_of_entry, minlength=num_rows))])


def _ragged(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, position) for every element of rows [starts, starts + lengths): a CSR gather without loops."""
    rows = torch.repeat_interleave(torch.arange(len(starts), device=starts.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # where each row's run begins in the flat output
    return rows, torch.arange(len(rows), device=starts.device) - first[rows] + starts[rows]


class NGramModel:
    def __init__(self, arrays: dict[str, torch.Tensor], vocab_size: int, tokenizer_sha256: str | None,
                 note: dict[str, str] | None = None):
        self.arrays = arrays  # name -> CPU tensor, as in `_ARRAYS`
        self.vocab_size = vocab_size
        self.tokenizer_sha256 = tokenizer_sha256
        self.note = dict(note or {})  # free-text metadata: corpus, discounts, cutoff
        self._devices: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._host = None  # top tokens as Python tuples, built on first use by top_tokens_host

    # ------------------------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, sequences, vocab_size: int, tokenizer_sha256: str | None = None, *,
            min_trigram_count: int = 1, corpus: str = "") -> "NGramModel":
        """Count the n-grams inside each sequence (never across two) and build the backoff model."""
        V = vocab_size
        unigram = np.zeros(V, dtype=np.int64)
        bigram_keys, trigram_keys = [], []
        for seq in sequences:
            s = np.asarray(seq, dtype=np.int64)
            if s.size and (s.min() < 0 or s.max() >= V):
                raise NGramError(f"fit: token ids must lie in [0, {V}), got {s.min()}..{s.max()}")
            unigram += np.bincount(s, minlength=V)
            bigram_keys.append(s[:-1] * V + s[1:])
            trigram_keys.append((s[:-2] * V + s[1:-1]) * V + s[2:])
        unigram_prob = (unigram + 1) / (unigram.sum() + V)
        bi, bi_count = np.unique(np.concatenate(bigram_keys + [np.zeros(0, np.int64)]), return_counts=True)
        tri, tri_count = np.unique(np.concatenate(trigram_keys + [np.zeros(0, np.int64)]), return_counts=True)
        del bigram_keys, trigram_keys

        # bigrams: one CSR row per token v (rows of unseen contexts are empty)
        bi_star, bi_method = discounted_counts(bi_count)
        bi_ctx, bi_tok = bi // V, bi % V
        bi_total = np.bincount(bi_ctx, weights=bi_count, minlength=V)
        bi_prob = bi_star / bi_total[bi_ctx]
        bi_prob, bi_backoff = cls._backoff(bi_ctx, bi_count, bi_prob, unigram_prob[bi_tok], bi_total[bi_ctx], V)

        # trigrams: contexts u*V + v, discounted on the full counts, then the cutoff
        tri_star, tri_method = discounted_counts(tri_count)
        ctx_keys, ctx_index = np.unique(tri // V, return_inverse=True)
        ctx_total = np.bincount(ctx_index, weights=tri_count)
        keep = tri_count >= min_trigram_count
        tri, tri_count, tri_star, ctx_index = tri[keep], tri_count[keep], tri_star[keep], ctx_index[keep]
        tri_prob = tri_star / ctx_total[ctx_index]
        lower = cls._bigram_probability(tri // V % V, tri % V, bi, bi_prob, bi_backoff, unigram_prob, V)
        tri_prob, tri_backoff = cls._backoff(ctx_index, tri_count, tri_prob, lower, ctx_total[ctx_index],
                                             len(ctx_keys))
        used = np.unique(ctx_index)  # contexts whose every trigram was cut off behave as unseen: drop them
        ctx_index = np.searchsorted(used, ctx_index)

        arrays = {
            "unigram_prob": unigram_prob, "bigram_ptr": _row_pointers(bi_ctx, V), "bigram_token": bi_tok,
            "bigram_prob": bi_prob, "bigram_backoff": bi_backoff, "trigram_context": ctx_keys[used],
            "trigram_ptr": _row_pointers(ctx_index, len(used)), "trigram_token": tri % V,
            "trigram_prob": tri_prob, "trigram_backoff": tri_backoff[used],
        }
        arrays = {k: torch.from_numpy(np.ascontiguousarray(v)).to(_ARRAYS[k]) for k, v in arrays.items()}
        note = {"corpus": corpus, "tokens": str(int(unigram.sum())), "bigram_discount": bi_method,
                "trigram_discount": tri_method, "min_trigram_count": str(min_trigram_count)}
        return cls(arrays, V, tokenizer_sha256, note)

    @staticmethod
    def _backoff(ctx, count, prob, lower_prob, total, num_contexts):
        """(p* per n-gram, beta per context), float64, with the two edge cases of the module doc."""
        left = 1 - np.bincount(ctx, weights=prob, minlength=num_contexts)
        room = 1 - np.bincount(ctx, weights=lower_prob, minlength=num_contexts)
        full, starved = room <= 1e-12, left <= 1e-9
        prob = np.where(full[ctx], count / total, np.where(starved[ctx], count / (total + 1), prob))
        left = 1 - np.bincount(ctx, weights=prob, minlength=num_contexts)
        return prob, np.where(full, 0.0, left / np.where(full, 1.0, room))

    @staticmethod
    def _bigram_probability(v, w, keys, prob, backoff, unigram_prob, V):
        """p(w | v) for arrays of (v, w) pairs, from the sorted bigram keys."""
        at = np.minimum(np.searchsorted(keys, v * V + w), max(len(keys) - 1, 0))
        seen = keys[at] == v * V + w if len(keys) else np.zeros(len(v), bool)
        return np.where(seen, prob[at] if len(keys) else 0.0, backoff[v] * unigram_prob[w])

    # ------------------------------------------------------------------------------------ files
    def save(self, path) -> None:
        """Write a safetensors file atomically (`perfmodel.jsonio.atomic_output`)."""
        from safetensors.torch import save_file

        path = Path(path)
        metadata = {"schema": SCHEMA, "vocab_size": str(self.vocab_size), "order": "3",
                    "tokenizer_sha256": self.tokenizer_sha256 or "", **self.note}
        with atomic_output(path) as temporary:
            save_file({k: v.contiguous() for k, v in self.arrays.items()}, str(temporary), metadata=metadata)

    @classmethod
    def load(cls, path) -> "NGramModel":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise NGramError(f"{path}: no such n-gram file")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                arrays = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as error:  # safetensors raises its own SafetensorError or OSError
            raise NGramError(f"{path}: not a readable safetensors file ({error})") from None
        if metadata.get("schema") != SCHEMA:
            raise NGramError(f"{path}: schema is {metadata.get('schema')!r}, expected {SCHEMA!r}")
        try:
            V = int(metadata["vocab_size"])
        except (KeyError, ValueError):
            raise NGramError(f"{path}: metadata vocab_size is missing or not an integer") from None
        for name, dtype in _ARRAYS.items():
            if name not in arrays or arrays[name].dtype != dtype or arrays[name].dim() != 1:
                raise NGramError(f"{path}: array {name!r} is missing or not a 1-d {dtype} array")
        a, C = arrays, len(arrays["trigram_context"])
        expected = {"unigram_prob": V, "bigram_ptr": V + 1, "bigram_backoff": V, "trigram_ptr": C + 1,
                    "trigram_backoff": C, "bigram_prob": len(a["bigram_token"]),
                    "trigram_prob": len(a["trigram_token"])}
        for name, length in expected.items():
            if len(a[name]) != length:
                raise NGramError(f"{path}: array {name!r} has {len(a[name])} entries, expected {length}")
        if a["bigram_ptr"][-1] != len(a["bigram_token"]) or a["trigram_ptr"][-1] != len(a["trigram_token"]):
            raise NGramError(f"{path}: row pointers do not match the token arrays")
        note = {k: v for k, v in metadata.items() if k not in ("schema", "vocab_size", "order", "tokenizer_sha256")}
        return cls({k: a[k] for k in _ARRAYS}, V, metadata.get("tokenizer_sha256") or None, note)

    def check_compatible(self, vocab_size: int, tokenizer_sha256: str | None, where: str) -> None:
        """The target's vocabulary size and tokenizer.json fingerprint (None: unknown, not compared)."""
        check_vocabulary(where, self.vocab_size, vocab_size)
        if tokenizer_sha256 and self.tokenizer_sha256 and tokenizer_sha256 != self.tokenizer_sha256:
            raise NGramError(f"{where}: n-gram file was fitted for tokenizer {self.tokenizer_sha256[:12]}, "
                             f"the model's tokenizer is {tokenizer_sha256[:12]}")

    # ------------------------------------------------------------------------------------ queries
    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The arrays on `device`, plus the ranked-token table, built once per device."""
        if device not in self._devices:
            tables = {k: v.to(device) for k, v in self.arrays.items()}
            self._devices[device] = tables
            tables["top"] = self._top_table(device)
        return self._devices[device]

    def distributions(self, contexts: torch.Tensor) -> torch.Tensor:
        """(n, 2) rows (u, v) -> (n, V) float32 next-token distributions; u = -1: bigram level only,
        u = v = -1: the unigram."""
        t = self._on(contexts.device)
        u, v = contexts[:, 0].long(), contexts[:, 1].long()
        has_v = v >= 0
        vv = v.clamp(min=0)
        # bigram level: beta(v) * p(w), then the seen bigrams of v overwrite their entries
        beta = torch.where(has_v, t["bigram_backoff"][vv], torch.ones((), device=contexts.device))
        out = beta[:, None] * t["unigram_prob"][None, :]  # (n, V)
        ptr = t["bigram_ptr"]
        rows, pos = _ragged(ptr[vv], torch.where(has_v, ptr[vv + 1] - ptr[vv], 0))
        out[rows, t["bigram_token"][pos].long()] = t["bigram_prob"][pos]
        # trigram level, for rows whose (u, v) was seen: scale by beta(u, v), overwrite the seen trigrams
        at, found = self._find_trigram_context(t, u, v)
        out = torch.where(found[:, None], out * t["trigram_backoff"][at][:, None], out)
        ptr = t["trigram_ptr"]
        rows, pos = _ragged(ptr[at], torch.where(found, ptr[at + 1] - ptr[at], 0))
        out[rows, t["trigram_token"][pos].long()] = t["trigram_prob"][pos]
        return out

    def _find_trigram_context(self, t, u, v):
        """Index into the trigram contexts of each (u, v), and whether it was seen (u < 0 never is)."""
        keys = t["trigram_context"]
        if len(keys) == 0:
            return torch.zeros_like(u), torch.zeros_like(u, dtype=torch.bool)
        key = u * self.vocab_size + v
        at = torch.searchsorted(keys, key).clamp(max=len(keys) - 1)
        return at, (keys[at] == key) & (u >= 0) & (v >= 0)

    def _top_table(self, device) -> torch.Tensor:
        """(contexts + V + 1, R) most probable tokens: rows for each seen trigram context, then each
        token v at the bigram level, then the unigram. Built in chunks of at most ~4M probabilities."""
        V, keys = self.vocab_size, self.arrays["trigram_context"].to(device)
        vs = torch.arange(V, device=device)
        contexts = torch.cat([torch.stack([keys // V, keys % V], 1), torch.stack([torch.full_like(vs, -1), vs], 1),
                              torch.full((1, 2), -1, device=device)])
        width, chunk = min(TOP_RANKS, V), max(1, (1 << 22) // V)
        parts = [torch.topk(_ranking_keys(self.distributions(contexts[i:i + chunk])), width).indices
                 for i in range(0, len(contexts), chunk)]
        return torch.cat(parts)

    def top_tokens(self, contexts: torch.Tensor, count: int) -> torch.Tensor:
        """(n, 2) rows (u, v) -> (n, count) long: most probable next tokens first, ties to the smaller id."""
        if not 0 < count <= self.vocab_size:
            raise NGramError(f"top_tokens: count {count} is not in 1..{self.vocab_size} (the vocabulary)")
        t = self._on(contexts.device)
        if count > t["top"].shape[1]:
            return torch.topk(_ranking_keys(self.distributions(contexts)), count).indices
        u, v = contexts[:, 0].long(), contexts[:, 1].long()
        at, found = self._find_trigram_context(t, u, v)
        fallback = torch.where(v >= 0, len(t["trigram_context"]) + v, len(t["trigram_context"]) + self.vocab_size)
        return t["top"][torch.where(found, at, fallback), :count]

    def top_tokens_host(self, u: int, v: int) -> tuple[int, ...]:
        """The most probable next tokens after (u, v) as Python ints (u = -1: bigram level), for
        guessing inside a decoding step without a device round trip per tree level."""
        if self._host is None:
            V, top = self.vocab_size, self._on(torch.device("cpu"))["top"].tolist()
            keys = self.arrays["trigram_context"].tolist()
            self._host = ({key: tuple(row) for key, row in zip(keys, top)},
                          [tuple(row) for row in top[len(keys):len(keys) + V]], tuple(top[-1]))
        trigram, bigram, unigram = self._host
        if v < 0:
            return unigram
        return trigram.get(u * self.vocab_size + v, bigram[v]) if u >= 0 else bigram[v]

    def probability(self, u: int, v: int, w: int) -> float:
        """p(w | u, v) in float64 from scalar look-ups: an implementation independent of `distributions`."""
        a, V = {k: t.numpy() for k, t in self.arrays.items()}, self.vocab_size

        def seen(ptr, tokens, row):  # index of w in the CSR row, or None
            hits = np.flatnonzero(tokens[ptr[row]:ptr[row + 1]] == w)
            return ptr[row] + hits[0] if len(hits) else None

        p = float(a["unigram_prob"][w])
        if v >= 0:
            at = seen(a["bigram_ptr"], a["bigram_token"], v)
            p = float(a["bigram_prob"][at]) if at is not None else float(a["bigram_backoff"][v]) * p
        keys = a["trigram_context"]
        c = int(np.searchsorted(keys, u * V + v))
        if u >= 0 and v >= 0 and c < len(keys) and keys[c] == u * V + v:
            at = seen(a["trigram_ptr"], a["trigram_token"], c)
            p = float(a["trigram_prob"][at]) if at is not None else float(a["trigram_backoff"][c]) * p
        return p
