"""One figure that explains a model: where speculation pays, and how well latency is fitted.

Left: goodput over (batch size b, speculation length k), each column divided by its best k's goodput
(absolute tokens/s span orders of magnitude across b), with the k*(b) curve on top: the chain family
(none and chains k = 1..max_k) as `strategy.StepModel` predicts it, as a chain-only table would choose.
Right: predicted against measured pass latency per role, with the +-5% band the fit aims for; for an engine's
model (`calibrate --engine vllm`), predicted against measured step time of its configurations instead.

matplotlib is a main dependency (`plot` is an everyday command); it is imported only here, so the rest of
perfmodel loads without it.
"""
from __future__ import annotations

import os

import numpy as np

from .acceptance import AcceptanceModel
from .errors import PerfModelError
from .model import FittedModel, check_max_batch, query_strategies


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PerfModelError("plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def goodput_grid(fitted: FittedModel, acceptance: AcceptanceModel, max_batch: int, context_len: int,
                 max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(relative goodput of shape (max_k + 1, max_batch), best k per batch size of shape (max_batch,))."""
    check_max_batch(max_batch)
    choices = [query_strategies(fitted, acceptance, b, context_len, max_k, strategies="chain")
               for b in range(1, max_batch + 1)]
    goodput = np.array([[c.tokens_per_s for c in sorted(choice.ranked, key=lambda candidate: candidate.k)]
                        for choice in choices]).T  # (k, b)
    return goodput / goodput.max(axis=0, keepdims=True), np.array([choice.best.k for choice in choices])


def fit_panels(fitted: FittedModel) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, str]]:
    """(measured ms, predicted ms, batch sizes, title) of each fit shown: the pass latency per role, or an
    engine's steps."""
    if fitted.engine is not None:
        engine = fitted.engine
        measured = np.array([p.median_ms for p in engine.points])
        predicted = np.array([engine.step_ms(p.mode, p.batch_size, p.k, p.context_len) for p in engine.points])
        return [(measured, predicted, np.array([p.batch_size for p in engine.points]),
                 f"{engine.engine.describe()} steps, MAPE {engine.in_sample_mape_pct:.1f}%")]
    panels = []
    for role, fit in fitted.roles.items():
        p = fit.points
        predicted = np.asarray(fit.model.latency_ms(p.batch_size, p.new_tokens, p.context_len))
        title = f"{role}: {fit.kind}, MAPE {fit.in_sample_mape_pct:.1f}%"
        panels.append((p.latency_ms, predicted, p.batch_size, title))
    return panels


def plot_model(fitted: FittedModel, acceptance: AcceptanceModel, path: str | os.PathLike, max_batch: int = 64,
               context_len: int | None = None, max_k: int | None = None) -> None:
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter
    context_len = fitted.default_context_len() if context_len is None else context_len
    max_k = fitted.grid.max_k if max_k is None else max_k
    relative, best_k = goodput_grid(fitted, acceptance, max_batch, context_len, max_k)

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    heat = axes[0]
    image = heat.imshow(relative, origin="lower", aspect="auto", cmap="viridis", vmin=max(0.0, relative.min()),
                        vmax=1.0, extent=(0.5, max_batch + 0.5, -0.5, max_k + 0.5))
    heat.step(np.arange(1, max_batch + 1), best_k, where="mid", color="white", linewidth=2, label="best k")
    heat.set(xlabel="batch size b", ylabel="draft tokens k",
             title=f"goodput / best goodput at each b (context {context_len})")
    heat.legend(loc="upper right")
    figure.colorbar(image, ax=heat)

    panels = fit_panels(fitted)
    for axis in axes[1 + len(panels):]:
        axis.set_axis_off()
    for axis, (measured, predicted, batch_size, title) in zip(axes[1:], panels):
        points = axis.scatter(measured, predicted, c=np.log2(batch_size), s=12, cmap="plasma")
        span = np.array([min(measured.min(), predicted.min()), max(measured.max(), predicted.max())])
        axis.plot(span, span, color="black", linewidth=1)
        axis.fill_between(span, 0.95 * span, 1.05 * span, color="grey", alpha=0.3, label="+-5%")
        axis.set(xscale="log", yscale="log", xlabel="measured ms", ylabel="predicted ms",
                 title=title)
        axis.xaxis.set_minor_formatter(NullFormatter())  # minor log labels collide on short spans
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.legend(loc="upper left")
        figure.colorbar(points, ax=axis, label="log2 batch size")
    figure.tight_layout()
    try:
        save_figure(figure, path)
    finally:
        plt.close(figure)


def save_figure(figure, path: str | os.PathLike) -> None:
    """Through the one atomic writer (a device node or folder at `path` is refused, never replaced); the
    image format follows the file's extension."""
    from pathlib import Path

    from .jsonio import atomic_output, writable_path

    writable_path(path, "--output")
    fmt = Path(path).suffix.lstrip(".").lower()
    formats = figure.canvas.get_supported_filetypes()
    if fmt not in formats:
        raise PerfModelError(f"--output {path}: give a file ending in one of .{', .'.join(sorted(formats))}")
    with atomic_output(path, "--output") as temporary:
        figure.savefig(temporary, dpi=110, format=fmt)
