"""Reliability diagram and confidence histogram (Figure 6 of Panigrahi et al. 2023) with matplotlib.

Only the object-oriented API is used (``matplotlib.figure.Figure`` + ``FigureCanvasAgg``), never ``pyplot``: no
display, no global figure state, safe inside training loops and on headless machines.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .metrics import (
    DEFAULT_N_BINS,
    ArrayLike,
    InputType,
    _format_inputs,
    _n_bins_arg_validation,
    reliability_bins,
    top_label_confidence,
)

__all__ = ["confidence_histogram", "reliability_diagram", "save_figure"]

DEFAULT_SIZE_PX = (480, 480)
DEFAULT_DPI = 100


def _new_figure(size_px: tuple[int, int], dpi: int) -> Figure:
    if len(size_px) != 2 or any(int(v) != v or v < 16 for v in size_px):
        raise ValueError(f"Argument `size_px` must be (width, height) in whole pixels >= 16, got {size_px!r}.")
    if dpi <= 0:
        raise ValueError(f"Argument `dpi` must be > 0, got {dpi!r}.")
    fig = Figure(figsize=(size_px[0] / dpi, size_px[1] / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _confidences_and_correct(
    preds: ArrayLike | None,
    labels: ArrayLike | None,
    confidences: ArrayLike | None,
    correct: ArrayLike | None,
    input_type: InputType,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if preds is not None:
        if confidences is not None or correct is not None:
            raise ValueError("Pass either `preds` (with `labels`) or `confidences`/`correct`, not both.")
        if labels is None:
            raise ValueError("Argument `labels` is required together with `preds`.")
        probs, target = _format_inputs(preds, labels, input_type)
        return top_label_confidence(probs, target)
    if confidences is None:
        raise ValueError("Pass `preds` and `labels`, or precomputed top-label `confidences` (and `correct`).")
    conf = torch.as_tensor(confidences, dtype=torch.float64).reshape(-1)
    return conf, None if correct is None else torch.as_tensor(correct).reshape(-1)


def reliability_diagram(
    preds: ArrayLike | None = None,
    labels: ArrayLike | None = None,
    *,
    confidences: ArrayLike | None = None,
    correct: ArrayLike | None = None,
    n_bins: int = DEFAULT_N_BINS,
    input_type: InputType = "auto",
    title: str | None = None,
    size_px: tuple[int, int] = DEFAULT_SIZE_PX,
    dpi: int = DEFAULT_DPI,
) -> Figure:
    """Reliability diagram: per-bin accuracy against confidence, with the gap to the diagonal (Guo et al. 2017).

    Args:
        preds: Logits or probabilities (any format accepted by the metrics). Alternatively give ``confidences`` and
            ``correct``.
        labels: Integer labels, with ``preds``.
        confidences: Precomputed top-label confidences ``(n,)``.
        correct: Precomputed correctness ``(n,)``, with ``confidences``.
        n_bins: Number of equal-width bins (same binning as the ECE).
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
        title: Axes title; the ECE is appended.
        size_px: Figure size ``(width, height)`` in pixels when saved at ``dpi``.
        dpi: Resolution.

    Returns:
        A ``matplotlib.figure.Figure`` with an Agg canvas attached (save it with :func:`save_figure`).
    """
    _n_bins_arg_validation(n_bins)
    conf, hits = _confidences_and_correct(preds, labels, confidences, correct, input_type)
    if hits is None:
        raise ValueError("Argument `correct` is required with `confidences` for a reliability diagram.")
    bins = reliability_bins(conf, hits, n_bins)
    edges = bins.edges.numpy()
    width = edges[1:] - edges[:-1]
    left = edges[:-1]
    acc, mean_conf, nonempty = bins.accuracy.numpy(), bins.confidence.numpy(), bins.counts.numpy() > 0

    fig = _new_figure(size_px, dpi)
    ax = fig.add_subplot()
    ax.bar(left, acc, width=width, align="edge", color="tab:blue", edgecolor="black", linewidth=0.5, label="Accuracy")
    gap_bottom = [min(a, c) for a, c in zip(acc, mean_conf, strict=True)]
    gap_height = [abs(a - c) if ne else 0.0 for a, c, ne in zip(acc, mean_conf, nonempty, strict=True)]
    ax.bar(
        left, gap_height, bottom=gap_bottom, width=width, align="edge", color="tab:red", alpha=0.3,
        edgecolor="tab:red", hatch="//", linewidth=0.5, label="Gap",
    )  # fmt: skip
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="Confidence", ylabel="Accuracy")
    label = f"ECE = {100 * bins.expected_error():.2f}%"
    ax.set_title(f"{title}\n{label}" if title else label, fontsize="medium")
    ax.legend(loc="upper left", fontsize="small")
    return fig


def confidence_histogram(
    preds: ArrayLike | None = None,
    labels: ArrayLike | None = None,
    *,
    confidences: ArrayLike | None = None,
    correct: ArrayLike | None = None,
    n_bins: int = 20,
    input_type: InputType = "auto",
    title: str | None = None,
    size_px: tuple[int, int] = DEFAULT_SIZE_PX,
    dpi: int = DEFAULT_DPI,
) -> Figure:
    """Histogram of top-label prediction probabilities (Figure 6 of the grafting paper).

    The y-axis is the fraction of examples. When correctness is known, vertical lines mark the accuracy and the
    mean confidence (their distance is the over/under-confidence).

    Args:
        preds: Logits or probabilities; alternatively ``confidences`` (and optionally ``correct``).
        labels: Integer labels, with ``preds``.
        confidences: Precomputed top-label confidences ``(n,)``.
        correct: Optional precomputed correctness ``(n,)``.
        n_bins: Number of histogram bars over ``[0, 1]``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
        title: Axes title.
        size_px: Figure size ``(width, height)`` in pixels when saved at ``dpi``.
        dpi: Resolution.

    Returns:
        A ``matplotlib.figure.Figure``.
    """
    _n_bins_arg_validation(n_bins)
    conf, hits = _confidences_and_correct(preds, labels, confidences, correct, input_type)
    counts = reliability_bins(conf, torch.zeros_like(conf), n_bins).counts
    edges = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins

    fig = _new_figure(size_px, dpi)
    ax = fig.add_subplot()
    ax.bar(edges[:-1].numpy(), (counts / counts.sum()).numpy(), width=1 / n_bins, align="edge", color="tab:blue",
           edgecolor="black", linewidth=0.5)  # fmt: skip
    mean_conf = float(conf.mean())
    ax.axvline(mean_conf, color="tab:red", linestyle="--", label=f"Avg. confidence {mean_conf:.3f}")
    if hits is not None:
        acc = float(hits.double().mean())
        ax.axvline(acc, color="black", linestyle="-", label=f"Accuracy {acc:.3f}")
    ax.set(xlim=(0, 1), xlabel="Top-label confidence", ylabel="Fraction of examples")
    if title:
        ax.set_title(title, fontsize="medium")
    ax.legend(loc="upper left", fontsize="small")
    return fig


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Save ``fig`` as PNG at its own size and dpi (no tight bounding box, so pixel size is exactly as requested)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.print_png(str(path))
    return path
