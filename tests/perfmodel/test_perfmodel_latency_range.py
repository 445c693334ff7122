"""The latency model owns its measured range: beyond it the table cannot turn on structure no measurement
shows, inside it the fit is untouched, and the notes say where the model extrapolates."""
import pytest

from specbatch.perfmodel.latency import Box
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import choose_acceptance, compute_table
from specbatch.perfmodel.profile import profile_from_json
from perfmodel_fixtures import CPU_MODELS, build_profile, cpu_like_latency


@pytest.fixture(scope="module")
def fitted():
    """A CPU-like profile measured up to batch size 32 (the fixture the refined fit bends beyond 32)."""
    obj = build_profile(cpu_like_latency, models=CPU_MODELS, batch_sizes=(1, 2, 4, 8, 16, 32), context_lens=(64, 256),
                        max_k=8, acceptance=[0.9])
    model = fit_profile(profile_from_json(obj))
    assert model.roles["target"].kind == "roofline+monotone"  # the refined form is what could invent structure
    return model


def test_the_table_never_rises_beyond_the_grid(fitted):
    table = compute_table(fitted, choose_acceptance(fitted, None), 96, strategies="chain")
    ks = [entry.k for entry in table.buckets[0].entries]
    beyond = ks[31:]  # b = 32..96
    assert all(later <= earlier for earlier, later in zip(beyond, beyond[1:])), beyond


def test_inside_the_grid_the_fit_is_untouched_and_outside_the_roofline_scales_its_edge(fitted):
    fit = fitted.roles["target"]
    model, roofline, shape = fit.model, fit.model.roofline, fit.model.shape
    assert fitted.latency_ms("target", 8, 3, 100) == float(model.fitted_ms(8, 3, 100))
    edge = float(model.fitted_ms(32, 9, 256))  # b, n and L all clipped to the box's corner
    expected = edge * roofline.latency_ms(shape, 64, 12, 1024) / roofline.latency_ms(shape, 32, 9, 256)
    assert fitted.latency_ms("target", 64, 12, 1024) == pytest.approx(expected)
    assert model.latency_ms(32, 9, 256) == pytest.approx(edge)  # continuous at the edge
    assert model.box == Box.of(fit.points) == Box((1.0, 32.0), (1.0, 9.0), (64.0, 256.0))
    # far beyond the edge the refinement's own extrapolation differs: the range is what holds it
    assert float(model.fitted_ms(64, 12, 1024)) != pytest.approx(expected, rel=1e-3)


def test_notes_say_where_the_model_extrapolates(fitted):
    notes = fitted.extrapolation_notes(64, [1024], 8)
    assert notes[0].startswith("extrapolating: batch sizes above 32") and "roofline alone" in notes[0]
    assert notes[1].startswith("extrapolating: context lengths [1024] lie outside the profiled [64, 256]")
    assert fitted.extrapolation_notes(32, [128], 8) == []


def test_arrays_of_pass_widths_give_the_scalar_values_inside_and_outside_the_grid(fitted):
    import numpy as np

    from specbatch.perfmodel.model import step_model
    from specbatch.perfmodel.tree import Strategy

    for role in ("target", "draft"):
        for b, L in ((1, 64), (8, 100), (32, 256), (48, 600), (96, 20)):  # inside, between, beyond b, L
            widths = np.arange(1, 12)  # the grid measured up to max_k + 1 = 9 tokens per pass
            vectorized = fitted.latency_ms(role, b, widths, L)
            assert vectorized.shape == widths.shape
            assert vectorized.tolist() == pytest.approx([fitted.latency_ms(role, b, int(n), L) for n in widths],
                                                        rel=1e-12)
    # a step model filled by prefetch evaluates exactly as one that filled its cache pass by pass
    acceptance = choose_acceptance(fitted, None)
    warm, cold = step_model(fitted, acceptance), step_model(fitted, acceptance)
    warm.prefetch(12, 192, 10)
    for k in range(9):
        assert warm.evaluate(Strategy.from_k(k), 12, 192).step_ms == pytest.approx(
            cold.evaluate(Strategy.from_k(k), 12, 192).step_ms, rel=1e-12)


def test_default_table_buckets_step_over_the_profiled_contexts():
    from types import SimpleNamespace

    from specbatch.perfmodel.model import TABLE_BUCKET_RATIO, FittedModel

    def buckets(lo, hi):
        return FittedModel.table_context_lens(SimpleNamespace(profiled_context_range=lambda: (lo, hi)))

    assert buckets(128, 2048) == [128, 181, 256, 362, 512, 724, 1024, 1448, 2048]  # 128 * 2 ** (i / 2)
    assert buckets(100, 100) == [100]
    assert buckets(100, 120) == [100, 120]  # closer than the ratio: both ends, nothing between
    lengths = buckets(38, 387)  # an in-situ profile's range: 7 equal steps of (387 / 38) ** (1 / 7) = 1.39
    assert lengths[0] == 38 and lengths[-1] == 387 and len(lengths) == 8
    assert max(b / a for a, b in zip(lengths, lengths[1:])) <= TABLE_BUCKET_RATIO * 1.01
