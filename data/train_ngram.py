"""Fit the demo n-gram draft: a Katz backoff trigram model (runtime/ngram.py) over the demo pair's
byte-level tokens, on the demo pair's training files only.

    python data/train_ngram.py                 # writes data/models/demo-ngram.safetensors (seconds)
    python data/train_ngram.py --smoke         # 20 training files, written under runs/ (for tests)

Corpus: the training split recorded in data/models/split.json, each file one sequence `<bos> bytes <eos>`
as the demo pair was trained on, so no n-gram spans two files; the held-out files are read only to report
cross-entropy. No count cutoff: a byte vocabulary keeps the full table small.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from specbatch.data.train_demo_pair import VOCAB_SIZE, split_of, token_stream
from specbatch.runtime.ngram import NGramModel, tokenizer_fingerprint

ROOT = Path(__file__).resolve().parent.parent  # the package directory (the repository root in a checkout)

SPLIT = ROOT / "data" / "models" / "split.json"
TOKENIZER = ROOT / "data" / "models" / "demo-target" / "tokenizer.json"
EVAL_CHUNK_ROWS = 16384  # distributions() builds (rows, V) float32: 16k rows x 259 = 17 MB


def split_files(stdlib: Path, split: str) -> list[str]:
    """The files of one split as recorded in split.json, checked against the path-hash rule."""
    files = json.loads(SPLIT.read_text())["files"][split]
    wrong = [f for f in files if split_of(f) != split]
    missing = [f for f in files if not (stdlib / f).is_file()]
    if wrong or missing:
        raise SystemExit(f"{SPLIT}: {len(wrong)} files not in the {split!r} split by the hash rule, "
                         f"{len(missing)} missing under --stdlib {stdlib} (e.g. {(wrong + missing)[0]})")
    return files


def sequences(stdlib: Path, files: list[str]) -> list[np.ndarray]:
    return [token_stream(stdlib, [f]) for f in files]  # one <bos> ... <eos> sequence per file


def contexts_and_targets(seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every prediction inside each sequence: (u, v) rows (u = -1 for the second token) and the next token."""
    ctx, target = [], []
    for s in seqs:
        s = s.astype(np.int64)
        u = np.concatenate([[-1], s[:-2]])
        ctx.append(np.stack([u, s[:-1]], 1))
        target.append(s[1:])
    return torch.from_numpy(np.concatenate(ctx)), torch.from_numpy(np.concatenate(target))


@torch.no_grad()
def evaluate(model: NGramModel, seqs: list[np.ndarray]) -> dict:
    """Cross-entropy in bits per byte and top-1 accuracy over byte targets (<eos> excluded, like the
    demo pair's bits_per_byte); the unigram's figures alongside as the baseline."""
    ctx, target = contexts_and_targets(seqs)
    is_byte = target < 256
    ctx, target = ctx[is_byte], target[is_byte]
    bits, hits = 0.0, 0
    for i in range(0, len(target), EVAL_CHUNK_ROWS):
        c, t = ctx[i:i + EVAL_CHUNK_ROWS], target[i:i + EVAL_CHUNK_ROWS]
        bits -= torch.log2(model.distributions(c).gather(1, t[:, None]).double()).sum().item()
        hits += (model.top_tokens(c, 1)[:, 0] == t).sum().item()
    unigram = model.arrays["unigram_prob"].double()
    return {"bytes": len(target), "bits_per_byte": bits / len(target), "top1_accuracy": hits / len(target),
            "unigram_bits_per_byte": -torch.log2(unigram[target]).mean().item(),
            "unigram_top1_accuracy": (target == unigram.argmax()).double().mean().item()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=None,
                        help="default data/models/demo-ngram.safetensors (with --smoke: under runs/smoke/)")
    parser.add_argument("--min-trigram-count", type=int, default=1, help="Katz count cutoff (1 keeps all)")
    parser.add_argument("--smoke", action="store_true", help="20 training and 5 held-out files (for tests)")
    args = parser.parse_args(argv)
    out = args.out or (ROOT / "runs" / "smoke" / "demo-ngram.safetensors" if args.smoke
                       else ROOT / "data" / "models" / "demo-ngram.safetensors")
    out.parent.mkdir(parents=True, exist_ok=True)

    train, heldout = split_files(args.stdlib, "train"), split_files(args.stdlib, "heldout")
    if args.smoke:
        train, heldout = train[:20], heldout[:5]
    train_seqs = sequences(args.stdlib, train)
    started = time.perf_counter()
    model = NGramModel.fit(train_seqs, VOCAB_SIZE, tokenizer_fingerprint(TOKENIZER),
                           min_trigram_count=args.min_trigram_count,
                           corpus=f"{len(train)} training files of data/models/split.json (Python stdlib)")
    fit_s = time.perf_counter() - started
    model.save(out)
    report = {
        "out": str(out), "file_bytes": out.stat().st_size, "fit_seconds": round(fit_s, 2),
        "train_files": len(train), "train_tokens": int(sum(len(s) for s in train_seqs)),
        "bigrams": len(model.arrays["bigram_token"]), "trigrams": len(model.arrays["trigram_token"]),
        "trigram_contexts": len(model.arrays["trigram_context"]), **model.note,
        "heldout": {"files": len(heldout), **evaluate(model, sequences(args.stdlib, heldout))},
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
