"""The Katz backoff trigram draft (runtime/ngram.py) against probabilities worked out by hand on a tiny
corpus, plus consistency of its three query paths, its file format and the bundled demo n-gram."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specbatch.perfmodel.errors import UsageError
from specbatch.runtime.ngram import NGramError, NGramModel, discounted_counts, tokenizer_fingerprint

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "data" / "models"
DEMO_NGRAM = MODELS / "demo-ngram.safetensors"

# Tiny corpus, vocabulary 4. Counted inside each sequence:
#   unigrams  0:3  1:3  2:2  3:1                      N = 9
#   bigrams   (0,1):2  (1,2):2  (2,0):2  (1,3):1      counts-of-counts n_1 = 1, n_2 = 3, n_3 = 0
#   trigrams  (0,1,2):1  (1,2,0):2  (2,0,1):1  (0,1,3):1                  n_1 = 3, n_2 = 1, n_3 = 0
CORPUS = [[0, 1, 2, 0, 1, 3], [1, 2, 0]]


@pytest.fixture(scope="module")
def tiny():
    return NGramModel.fit(CORPUS, vocab_size=4)


@pytest.fixture(scope="module")
def demo():
    return NGramModel.load(DEMO_NGRAM)


def test_good_turing_discounts_by_hand():
    # n_1..n_7 = 30, 10, 5, 3, 2, 1, 1; tail = 6 n_6 / n_1 = 6/30 = 0.2
    # d_1 = (2*10/(1*30) - 0.2) / 0.8 = (0.6667 - 0.2) / 0.8 = 0.58333
    # d_3 = (4*3/(3*5) - 0.2) / 0.8 = (0.8 - 0.2) / 0.8 = 0.75    -> c* = 3 * 0.75 = 2.25
    # d_5 = (6*1/(5*2) - 0.2) / 0.8 = (0.6 - 0.2) / 0.8 = 0.5     -> c* = 5 * 0.5 = 2.5
    counts = np.repeat(np.arange(1, 8), [30, 10, 5, 3, 2, 1, 1])
    star, method = discounted_counts(counts)
    assert method.startswith("good-turing")
    assert star[0] == pytest.approx(0.7 / 1.2)
    assert star[counts == 3][0] == pytest.approx(2.25)
    assert star[counts == 5][0] == pytest.approx(2.5)
    assert star[counts == 6][0] == 6 and star[counts == 7][0] == 7  # above 5: not discounted


def test_absolute_discount_fallback_by_hand():
    # trigrams: n_1 = 3, n_2 = 1, n_3 = 0 -> d_2 = 3 n_3 / (2 n_2) = 0, ill-behaved -> D = 3 / (3 + 2*1) = 0.6
    star, method = discounted_counts(np.array([1, 2, 1, 1]))
    assert method == "absolute D = 0.6000" and star.tolist() == pytest.approx([0.4, 1.4, 0.4, 0.4])
    # bigrams: n_1 = 1, n_2 = 3 -> D = 1 / (1 + 6) = 1/7
    assert discounted_counts(np.array([2, 2, 2, 1]))[0] == pytest.approx([13 / 7, 13 / 7, 13 / 7, 6 / 7])
    # no count of 2: D = n_1 / n_1 = 1 would give singletons p = 0, so D = 1/2
    assert discounted_counts(np.array([1, 1, 3]))[0] == pytest.approx([0.5, 0.5, 2.5])


def test_probabilities_by_hand(tiny):
    # unigram, add-one over V = 4: p(w) = (c + 1) / (9 + 4) -> 4/13, 4/13, 3/13, 2/13
    assert tiny.probability(-1, -1, 3) == pytest.approx(2 / 13)
    # bigram context 1 (c = 3, D = 1/7): p*(2|1) = (2 - 1/7)/3 = 13/21, p*(3|1) = (1 - 1/7)/3 = 6/21
    # left = 1 - 19/21 = 2/21; beta(1) = (2/21) / (1 - 3/13 - 2/13) = (2/21)/(8/13) = 13/84
    # backed-off bigram: p(0|1) = 13/84 * 4/13 = 1/21
    assert tiny.probability(-1, 1, 0) == pytest.approx(1 / 21)
    # bigram context 0 (c = 2): p*(1|0) = (2 - 1/7)/2 = 13/14; beta(0) = (1/14) / (1 - 4/13) = 13/126
    # trigram context (0,1) (c = 2, D = 0.6): seen trigram p*(2|0,1) = p*(3|0,1) = (1 - 0.6)/2 = 0.2
    assert tiny.probability(0, 1, 2) == pytest.approx(0.2)
    # left = 0.6; beta(0,1) = 0.6 / (1 - p(2|1) - p(3|1)) = 0.6 / (2/21) = 6.3
    # backed-off trigram: p(0|0,1) = 6.3 * p(0|1) = 6.3 / 21 = 0.3; p(1|0,1) = 6.3 * (13/84 * 4/13) = 0.3 (a tie)
    assert tiny.probability(0, 1, 0) == pytest.approx(0.3) and tiny.probability(0, 1, 1) == pytest.approx(0.3)
    # trigram context (2,0) (c = 1): p*(1|2,0) = 0.4; beta(2,0) = 0.6 / (1 - 13/14) = 8.4
    # backed off twice: p(3|2,0) = 8.4 * p(3|0) = 8.4 * (13/126 * 2/13) = 8.4 * 2/126 = 2/15
    assert tiny.probability(2, 0, 3) == pytest.approx(2 / 15)
    # unseen trigram context (3,0): beta = 1, the bigram level: p(1|3,0) = p*(1|0) = 13/14
    assert tiny.probability(3, 0, 1) == pytest.approx(13 / 14)
    d = tiny.distributions(torch.tensor([[0, 1], [2, 0], [3, 0], [-1, 1]]))
    assert d.tolist() == [pytest.approx(row, abs=1e-6) for row in (
        [0.3, 0.3, 0.2, 0.2], [8.4 * 4 / 126, 0.4, 8.4 * 3 / 126, 2 / 15],
        [2 / 63, 13 / 14, 3 / 126, 2 / 126], [1 / 21, 1 / 21, 13 / 21, 6 / 21])]


def _all_contexts(vocab: int) -> torch.Tensor:
    u, v = torch.meshgrid(torch.arange(-1, vocab), torch.arange(-1, vocab), indexing="ij")
    keep = (v >= 0) | (u < 0)
    return torch.stack([u[keep], v[keep]], 1)


def _random_contexts(vocab: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, vocab, (n, 2), generator=gen)
    ctx[: n // 4, 0] = -1  # a quarter with one token of history
    return ctx


def _ranked(d: torch.Tensor) -> np.ndarray:
    """The reference ranking: probability descending, ties to the smaller id (a stable argsort)."""
    return np.argsort(-d.numpy(), axis=1, kind="stable")


def test_rows_are_distributions_equal_to_probability(tiny, demo):
    for model, ctx in ((tiny, _all_contexts(4)), (demo, _random_contexts(259, 24, seed=0))):
        d = model.distributions(ctx)
        assert d.shape == (len(ctx), model.vocab_size) and d.dtype == torch.float32
        assert torch.allclose(d.sum(1), torch.ones(len(ctx)), atol=1e-5) and (d > 0).all()
        for i, (u, v) in enumerate(ctx.tolist()):
            ws = range(model.vocab_size) if model is tiny else (0, 10, 32, 101, 256, 258)
            for w in ws:
                assert d[i, w].item() == pytest.approx(model.probability(u, v, w), rel=1e-5)


def test_top_tokens_match_the_ranked_distribution(tiny, demo):
    assert tiny.top_tokens(torch.tensor([[0, 1]]), 4).tolist() == [[0, 1, 2, 3]]  # the 0.3/0.3 tie: 0 first
    for model, ctx in ((tiny, _all_contexts(4)), (demo, _random_contexts(259, 200, seed=1))):
        ranked = _ranked(model.distributions(ctx))
        for count in sorted({1, 3, min(8, model.vocab_size), model.vocab_size}):  # 259 > R: the topk fallback
            top = model.top_tokens(ctx, count)
            assert top.dtype == torch.long and np.array_equal(top.numpy(), ranked[:, :count])
    with pytest.raises(NGramError, match="count 0"):
        tiny.top_tokens(torch.tensor([[0, 1]]), 0)


def test_count_cutoff_moves_mass_to_the_backoff():
    # Katz cutoff: trigrams seen once are dropped but the discounts and c(u, v) keep them, so
    # context (0,1) keeps left = 1 - 0 = 1 and p(w|0,1) = p(w|1) exactly: beta = 1 / (1 - 0) = 1
    pruned = NGramModel.fit(CORPUS, vocab_size=4, min_trigram_count=2)
    d = pruned.distributions(_all_contexts(4))
    assert torch.allclose(d.sum(1), torch.ones(len(d)), atol=1e-6) and (d > 0).all()
    assert pruned.probability(0, 1, 0) == pytest.approx(1 / 21)
    # the kept trigram (1,2,0) (count 2, D = 0.6 from the full counts): p*(0|1,2) = 1.4 / 2 = 0.7
    assert pruned.probability(1, 2, 0) == pytest.approx(0.7)


def test_context_whose_counts_escape_discounting_keeps_mass_for_unseen_tokens():
    # each 3-token sequence is exactly one trigram: 51 trigrams over tokens 0..8 with counts-of-counts
    # n_1..n_6 = 30, 10, 5, 3, 2, 1 (Good-Turing is well-behaved), plus (9, 9, 0) seen 7 times. Context
    # (9, 9) has only a count above 5, so plain Katz leaves unseen tokens nothing; it gets one pseudo-count
    # for "unseen": p*(0|9,9) = 7 / (7 + 1), and the other 1/8 is shared out by the bigram level.
    grams = [(i // 9, i % 9, (i * 7) % 9) for i in range(51)]
    counts = np.repeat(np.arange(1, 7), [30, 10, 5, 3, 2, 1])
    sequences = [list(g) for g, c in zip(grams, counts) for _ in range(c)] + [[9, 9, 0]] * 7
    model = NGramModel.fit(sequences, vocab_size=10)
    assert model.note["trigram_discount"].startswith("good-turing")
    assert model.probability(9, 9, 0) == pytest.approx(7 / 8)
    d = model.distributions(_all_contexts(10))
    assert torch.allclose(d.sum(1), torch.ones(len(d)), atol=1e-5) and (d > 0).all()


def test_context_that_saw_every_token_and_bad_ids():
    model = NGramModel.fit([[0, 0, 1, 1, 0, 1, 0, 0, 1]], vocab_size=2)  # bigram context 0 saw 0 and 1
    d = model.distributions(_all_contexts(2))
    assert torch.allclose(d.sum(1), torch.ones(len(d)), atol=1e-6) and (d > 0).all()
    with pytest.raises(NGramError, match=r"\[0, 4\)"):
        NGramModel.fit([[0, 4]], vocab_size=4)


def test_save_load_round_trip(tiny, tmp_path):
    model = NGramModel.fit(CORPUS, vocab_size=4, tokenizer_sha256="ab" * 32, corpus="two lists")
    path = tmp_path / "tiny.safetensors"
    model.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.safetensors"]  # no temporary file left behind
    back = NGramModel.load(path)
    assert (back.vocab_size, back.tokenizer_sha256, back.note) == (4, "ab" * 32, model.note)
    assert back.note["corpus"] == "two lists"
    assert all(torch.equal(back.arrays[k], v) for k, v in model.arrays.items())
    ctx = _all_contexts(4)
    assert torch.equal(back.distributions(ctx), tiny.distributions(ctx))
    tiny.save(path)
    assert NGramModel.load(path).tokenizer_sha256 is None


def test_load_errors_name_the_file(tiny, tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    tiny.save(good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:200])
    text = tmp_path / "text.safetensors"
    text.write_text("not a safetensors file")
    schema = tmp_path / "schema.safetensors"
    save_file(tiny.arrays, str(schema), metadata={"schema": "specbatch.ngram/0", "vocab_size": "4"})
    missing_array = tmp_path / "missing_array.safetensors"
    arrays = {k: v for k, v in tiny.arrays.items() if k != "trigram_prob"}
    save_file(arrays, str(missing_array), metadata={"schema": "specbatch.ngram/1", "vocab_size": "4"})
    wrong_shape = tmp_path / "wrong_shape.safetensors"
    save_file(tiny.arrays, str(wrong_shape), metadata={"schema": "specbatch.ngram/1", "vocab_size": "5"})
    cases = [(tmp_path / "absent.safetensors", "no such"), (truncated, "not a readable"), (text, "not a readable"),
             (schema, "schema"), (missing_array, "trigram_prob"), (wrong_shape, "unigram_prob")]
    for path, what in cases:
        with pytest.raises(NGramError, match=what) as info:
            NGramModel.load(path)
        assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_check_compatible(tiny):
    model = NGramModel.fit(CORPUS, vocab_size=4, tokenizer_sha256="a" * 64)
    model.check_compatible(4, "a" * 64, "--ngram x")
    model.check_compatible(4, None, "--ngram x")  # unknown hash on either side: no hash check
    tiny.check_compatible(4, "b" * 64, "--ngram x")
    with pytest.raises(UsageError, match="--ngram x: a vocabulary of 4 tokens, the target's has 259"):
        model.check_compatible(259, "a" * 64, "--ngram x")
    with pytest.raises(NGramError, match=f"fitted for tokenizer {'a' * 12}, the model's tokenizer is {'b' * 12}"):
        model.check_compatible(4, "b" * 64, "--ngram x")


def test_tokenizer_fingerprint(tmp_path):
    target = tokenizer_fingerprint(MODELS / "demo-target" / "tokenizer.json")
    assert target == tokenizer_fingerprint(MODELS / "demo-draft" / "tokenizer.json")
    data = json.loads((MODELS / "demo-target" / "tokenizer.json").read_text())
    reformatted = tmp_path / "reformatted.json"
    reformatted.write_text(json.dumps(data, indent=4))
    assert tokenizer_fingerprint(reformatted) == target
    vocab = data["model"]["vocab"]
    vocab["renamed"] = vocab.pop("a")
    modified = tmp_path / "modified.json"
    modified.write_text(json.dumps(data))
    assert tokenizer_fingerprint(modified) != target
    with pytest.raises(NGramError, match="absent.json"):
        tokenizer_fingerprint(tmp_path / "absent.json")


def test_bundled_demo_ngram(demo):
    fingerprint = tokenizer_fingerprint(MODELS / "demo-target" / "tokenizer.json")
    assert demo.vocab_size == 259 and demo.tokenizer_sha256 == fingerprint
    demo.check_compatible(259, fingerprint, "demo")
    # behaviour: greedy next-byte guesses on held-out prompts beat always guessing the unigram's favourite
    lines = (ROOT / "data" / "prompts" / "heldout.jsonl").read_text().splitlines()[:10]
    hits = unigram_hits = total = 0
    for text in map(json.loads, lines):
        ids = torch.tensor([256] + list(text.encode()))  # <bos> then the bytes
        ctx = torch.stack([torch.cat([torch.tensor([-1]), ids[:-2]]), ids[:-1]], 1)
        hits += (demo.top_tokens(ctx, 1)[:, 0] == ids[1:]).sum().item()
        unigram_hits += (demo.top_tokens(torch.full_like(ctx, -1), 1)[:, 0] == ids[1:]).sum().item()
        total += len(ids) - 1
    assert hits / total > 0.35 and hits > 1.5 * unigram_hits
