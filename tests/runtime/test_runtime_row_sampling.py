"""Per-request sampling in one pass over the batch (the serving engine's rows).

Oracles: the one-setting `probabilities` applied row by row (itself checked against transformers'
warpers), splitmix64 written with Python integers, exact distributions (chi-square), and the same
request's stream drawn alone and inside other batches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.runtime.sampling import RowGenerators, RowSampling, Sampling, _mix64, probabilities, sample, uniform

scipy_stats = pytest.importorskip("scipy.stats")

SETTINGS = (Sampling(), Sampling(temperature=0.7), Sampling(temperature=1.3, top_k=5),
            Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.8, top_k=10, top_p=0.7),
            Sampling(temperature=1.0, top_p=0.3), Sampling(temperature=2.0, top_k=1),
            Sampling(temperature=0.5, top_k=40))


@pytest.mark.parametrize("shape", [(8, 40), (8, 3, 40)], ids=["(b, vocab)", "(b, positions, vocab)"])
def test_each_row_gets_exactly_its_own_settings(shape):
    logits = 3.0 * torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = probabilities(logits, RowSampling(SETTINGS))
    for row, setting in enumerate(SETTINGS):
        if setting.greedy:
            expected = torch.nn.functional.one_hot(logits[row].argmax(-1), shape[-1]).float()
        else:
            expected = probabilities(logits[row], setting)
        assert torch.allclose(ours[row], expected, atol=1e-6), setting.describe()
        assert ((ours[row] > 0) == (expected > 0)).all()


def test_the_hash_is_splitmix64():
    mask = (1 << 64) - 1

    def reference(x):
        x = (x + 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    values = [0, 1, 7, 2**40 + 3, 2**63 - 1, -1, -(2**63), 123456789123]
    assert [v & mask for v in _mix64(torch.tensor(values)).tolist()] == [reference(v & mask) for v in values]


def test_row_streams_are_uniform_and_independent():
    rng = RowGenerators(list(range(1000, 1064)), [0] * 64, "cpu")
    u = uniform((64, 500), rng, "cpu").numpy()
    assert u.min() >= 0.0 and u.max() < 1.0 and rng.drawn == 500
    assert scipy_stats.kstest(u.ravel(), "uniform").pvalue > 1e-3
    correlation = np.corrcoef(u)  # rows against rows: seeds 1000..1063 must not track each other
    assert np.abs(correlation[np.triu_indices(64, 1)]).max() < 0.25
    wide = uniform((64, 10), rng, "cpu", torch.float64).numpy()
    assert scipy_stats.kstest(wide.ravel(), "uniform").pvalue > 1e-3


def test_a_rows_stream_is_its_own_whoever_shares_the_batch():
    alone = RowGenerators([42], [100], "cpu")
    crowd = RowGenerators([7, 42, 9], [0, 100, 55], "cpu")
    first = uniform((1, 5), alone, "cpu"), uniform((3, 5), crowd, "cpu")
    assert torch.equal(first[0][0], first[1][1])
    resumed = RowGenerators([42], [105], "cpu")  # the engine resumes a request at offset + drawn
    assert torch.equal(uniform((1, 3), resumed, "cpu"), uniform((1, 3), alone, "cpu"))


def test_sampling_by_row_streams_follows_the_distribution_and_never_draws_zero_probability():
    probs = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    rows = 40_000
    rng = RowGenerators(list(range(rows)), [0] * rows, "cpu")
    drawn = sample(probs.expand(rows, -1), rng)
    counts = np.bincount(drawn.numpy(), minlength=len(probs))
    assert counts[1] == counts[6] == 0
    support = probs > 0
    assert scipy_stats.chisquare(counts[support.numpy()], rows * probs[support].numpy()).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-30, 1e-8])
def test_a_temperature_however_small_gives_the_argmax_not_nan(temperature):
    """The limit T -> 0 is greedy: the one-hot distribution at the argmax (both paths, any logits' scale)."""
    logits = torch.tensor([[3.0, 7.5, -2.0, 7.4], [1e4, -1e4, 0.0, 5.0]])
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 4).float()
    assert torch.equal(probabilities(logits, Sampling(temperature=temperature)), expected)
    rows = RowSampling((Sampling(temperature=temperature), Sampling(temperature=temperature, top_p=1e-300)))
    assert torch.equal(probabilities(logits, rows), expected)


def test_a_top_p_however_small_keeps_the_top_token():
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]])
    assert torch.equal(probabilities(logits, Sampling(temperature=1.0, top_p=1e-300)),
                       torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
