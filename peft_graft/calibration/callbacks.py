"""Hugging Face ``Trainer`` integration: a ``compute_metrics`` factory and a ``TrainerCallback``.

Design: a ``TrainerCallback`` only sees the (prefixed) metrics of an evaluation, never the predictions. So the
``compute_metrics`` object returned by :func:`make_compute_metrics` computes the calibration metrics (the Trainer
logs them like any metric, as ``eval_ece``, ``eval_id_ece``, ...) and keeps a small snapshot of the last evaluation
(top-label confidences and correctness, ``2n`` numbers). The Trainer calls ``compute_metrics`` and then
``on_evaluate`` once per eval dataset with that dataset's metrics, so :class:`CalibrationCallback` picks up the
snapshot there, reads the metric key prefix (``eval``, ``eval_<name>``, ``test``) off the metric names it finds, logs a
summary and writes ``<prefix>-step<global_step>-reliability.png`` and ``...-confidence.png``. Wiring::

    compute_metrics = make_compute_metrics()
    trainer = Trainer(..., compute_metrics=compute_metrics, callbacks=[CalibrationCallback(compute_metrics)])

This works for any ``Trainer`` subclass that keeps the standard evaluation loop, with
``trainer.evaluate(eval_dataset={"id": ds1, "ood": ds2})`` (prefixes ``eval_id`` / ``eval_ood``), with
``trainer.predict`` (prefix ``test``) and with ``TrainingArguments(batch_eval_metrics=True)``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .metrics import (
    DEFAULT_N_BINS,
    REPORT_KEYS,
    InputType,
    _as_tensor,
    _format_labels,
    _format_preds,
    _input_type_arg_validation,
    _n_bins_arg_validation,
    _probabilities,
    calibration_report,
    f1_score,
    top_label_confidence,
)
from .plots import DEFAULT_DPI, DEFAULT_SIZE_PX, confidence_histogram, reliability_diagram, save_figure

__all__ = ["CalibrationCallback", "CalibrationMetrics", "EvalSnapshot", "make_compute_metrics"]

logger = logging.getLogger(__name__)


@dataclass
class EvalSnapshot:
    """What the last ``compute_metrics`` call saw: top-label confidences, correctness and its (unprefixed) metrics."""

    confidences: torch.Tensor
    correct: torch.Tensor
    metrics: dict[str, float]


def _first(x: Any) -> Any:
    """Trainer predictions/labels may be tuples (extra model outputs or several label columns): take the first."""
    while isinstance(x, tuple):
        x = x[0]
    return x


class CalibrationMetrics:
    """``compute_metrics`` callable for ``transformers.Trainer``: accuracy (and optionally F1) plus calibration.

    Create it with :func:`make_compute_metrics`. Returns a dict with ``accuracy``, ``f1`` (if requested) and the
    calibration metrics of :func:`~peft_graft.calibration.metrics.calibration_report` (``ece``, ``mce``,
    ``adaptive_ece``, ``classwise_ece``, ``brier``, ``nll`` by default). Supports ``batch_eval_metrics=True`` through
    the ``compute_result`` argument (batches are kept on CPU until the last, and an evaluation that raises leaves none).

    Attributes:
        last: :class:`EvalSnapshot` of the most recent complete evaluation, or ``None``; consumed by
            :class:`CalibrationCallback`.
    """

    def __init__(
        self,
        n_bins: int = DEFAULT_N_BINS,
        input_type: InputType = "auto",
        f1_average: Literal["binary", "macro"] | None = None,
        metrics: tuple[str, ...] | list[str] | None = None,
    ) -> None:
        _n_bins_arg_validation(n_bins)
        _input_type_arg_validation(input_type)
        if f1_average not in (None, "binary", "macro"):
            raise ValueError(f"Argument `f1_average` must be None, 'binary' or 'macro', got {f1_average!r}.")
        wanted = tuple(REPORT_KEYS if metrics is None else metrics)
        unknown = set(wanted) - set(REPORT_KEYS)
        if unknown:
            raise ValueError(f"Argument `metrics` has unknown names {sorted(unknown)}; choose from {REPORT_KEYS}.")
        self.n_bins = int(n_bins)
        self.input_type = input_type
        self.f1_average = f1_average
        self.metrics = wanted
        self.last: EvalSnapshot | None = None
        self._batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _probs_and_labels(self, predictions: Any, label_ids: Any) -> tuple[torch.Tensor, torch.Tensor]:
        preds = _as_tensor(_first(predictions), "predictions")
        if preds.ndim == 1 and not preds.is_floating_point():
            raise TypeError(
                "compute_metrics got integer class ids instead of logits; calibration needs the logits, so do not "
                "pass a `preprocess_logits_for_metrics` that takes the argmax."
            )
        values, is_logits = _format_preds(preds, self.input_type, "predictions")
        probs = _probabilities(values, is_logits)
        return probs, _format_labels(_first(label_ids), probs.shape[0], probs.shape[1])

    def __call__(self, eval_pred: Any, compute_result: bool | None = None) -> dict[str, float]:
        """Compute the metrics from a ``transformers.EvalPrediction`` (or a ``(predictions, label_ids)`` pair)."""
        predictions, label_ids = (
            (eval_pred.predictions, eval_pred.label_ids) if hasattr(eval_pred, "predictions") else eval_pred
        )
        if compute_result is None:
            return self.compute(*self._probs_and_labels(predictions, label_ids))
        # batch_eval_metrics=True: the raw batches are kept until the last one, then read as one set (so that
        # input_type="auto" decides logits or probabilities once, for the whole set)
        try:
            predictions = _as_tensor(_first(predictions), "predictions")
            self._batches.append((predictions, _as_tensor(_first(label_ids), "label_ids")))
            if not compute_result:
                return {}
            predictions = torch.cat([p for p, _ in self._batches])
            label_ids = torch.cat([y for _, y in self._batches])
            self.reset()
            return self.compute(*self._probs_and_labels(predictions, label_ids))
        except BaseException:
            self.reset()  # a failed evaluation leaves nothing behind for the next one
            raise

    def reset(self) -> None:
        """Forget the batches of an evaluation in progress (also done when ``Trainer.evaluation_loop`` raises)."""
        self._batches = []

    def compute(self, probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Metrics of validated ``(n, C)`` probabilities and labels; also stores :attr:`last`."""
        out: dict[str, float] = {}
        report = calibration_report(probs, labels, self.n_bins, "probs", metrics=self.metrics)
        if "accuracy" in report:
            out["accuracy"] = report.pop("accuracy")
        if self.f1_average is not None:
            out["f1"] = f1_score(probs, labels, self.f1_average, "probs")
        out.update(report)
        confidences, correct = top_label_confidence(probs, labels)
        self.last = EvalSnapshot(confidences.float(), correct, dict(out))
        return out

    def pop_last(self) -> EvalSnapshot | None:
        """Return and clear the snapshot of the last evaluation."""
        snapshot, self.last = self.last, None
        return snapshot


def make_compute_metrics(
    n_bins: int = DEFAULT_N_BINS,
    *,
    input_type: InputType = "auto",
    f1_average: Literal["binary", "macro"] | None = None,
    metrics: tuple[str, ...] | list[str] | None = None,
) -> CalibrationMetrics:
    """Build a ``compute_metrics`` for ``Trainer`` returning accuracy (+ F1) and calibration metrics.

    Args:
        n_bins: Number of bins for ECE/MCE/adaptive/classwise ECE (default 15: see ``DEFAULT_N_BINS``).
        input_type: How to read the model outputs: ``"auto"`` (default), ``"logits"`` or ``"probs"``.
        f1_average: Also report ``f1`` with this averaging (``"binary"`` for MRPC/QQP-style F1, or ``"macro"``).
        metrics: Subset of ``("accuracy", "ece", "mce", "adaptive_ece", "classwise_ece", "brier", "nll")``.

    Returns:
        A :class:`CalibrationMetrics`; pass it as ``compute_metrics=`` and to :class:`CalibrationCallback`.
    """
    return CalibrationMetrics(n_bins=n_bins, input_type=input_type, f1_average=f1_average, metrics=metrics)


def _metric_prefix(metrics: dict[str, Any], names: list[str]) -> str | None:
    """The prefix ``p`` the Trainer put on our metric names: every ``f"{p}_{name}"`` is a key of ``metrics``.

    The Trainer calls ``on_evaluate`` once per evaluation dataset with that evaluation's metrics only, each key
    prefixed by its ``metric_key_prefix`` (``eval``, ``eval_<dataset name>``, ``test``). Names alone suffice, so this
    does not depend on the values surviving any post-processing. The shortest candidate wins (``eval`` over
    ``eval_adaptive`` when ``ece`` is matched against ``eval_adaptive_ece``).
    """
    first, *rest = names
    candidates = {key[: -len(first) - 1] for key in metrics if key.endswith(f"_{first}")}
    matches = [p for p in candidates if all(f"{p}_{name}" in metrics for name in rest)]
    return min(matches, key=len) if matches else None


class CalibrationCallback(TrainerCallback):
    """Logs calibration metrics at every evaluation and writes a reliability diagram and confidence histogram.

    Args:
        compute_metrics: The :class:`CalibrationMetrics` passed to the Trainer as ``compute_metrics``: it keeps the
            top-label confidences of the last evaluation, which the plots need.
        output_dir: Where to write PNGs; default ``<args.output_dir>/calibration``.
        save_plots: Write the PNG files (otherwise only log).
        size_px: ``(width, height)`` of each PNG in pixels.
        dpi: Resolution of the PNGs.
        histogram_bins: Number of bars of the confidence histogram.

    Attributes:
        history: One dict per evaluation: ``step``, ``prefix``, ``metrics`` (prefixed calibration metrics) and
            ``reliability_diagram`` / ``confidence_histogram`` (file paths, or ``None``).
    """

    def __init__(
        self,
        compute_metrics: CalibrationMetrics,
        output_dir: str | os.PathLike | None = None,
        save_plots: bool = True,
        size_px: tuple[int, int] = DEFAULT_SIZE_PX,
        dpi: int = DEFAULT_DPI,
        histogram_bins: int = 20,
    ) -> None:
        if not isinstance(compute_metrics, CalibrationMetrics):
            raise TypeError(
                "Argument `compute_metrics` must be the object returned by `make_compute_metrics()` (the one passed "
                f"to the Trainer), got {type(compute_metrics).__name__}."
            )
        _n_bins_arg_validation(histogram_bins)
        self.compute_metrics = compute_metrics
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.save_plots = save_plots
        self.size_px = tuple(size_px)
        self.dpi = dpi
        self.histogram_bins = histogram_bins
        self.history: list[dict[str, Any]] = []

    def _write_plots(self, directory: Path, prefix: str, step: int, snapshot: EvalSnapshot) -> dict[str, str]:
        stem = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', prefix)}-step{step}"
        common = {"confidences": snapshot.confidences, "correct": snapshot.correct, "title": f"{prefix} (step {step})"}
        common.update(size_px=self.size_px, dpi=self.dpi)
        diagram = reliability_diagram(n_bins=self.compute_metrics.n_bins, **common)
        histogram = confidence_histogram(n_bins=self.histogram_bins, **common)
        return {
            "reliability_diagram": str(save_figure(diagram, directory / f"{stem}-reliability.png")),
            "confidence_histogram": str(save_figure(histogram, directory / f"{stem}-confidence.png")),
        }

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        snapshot = self.compute_metrics.pop_last()
        if snapshot is None:  # compute_metrics did not run (e.g. no labels, or prediction_loss_only)
            return
        prefix = _metric_prefix(metrics or {}, list(snapshot.metrics))
        if prefix is None:
            logger.warning(
                "CalibrationCallback: the evaluation metrics lack %s; no plots written.", list(snapshot.metrics)
            )
            return
        logged = {f"{prefix}_{name}": metrics[f"{prefix}_{name}"] for name in snapshot.metrics}
        record: dict[str, Any] = {"step": state.global_step, "prefix": prefix, "metrics": logged}
        record["reliability_diagram"] = record["confidence_histogram"] = None
        directory = self.output_dir or Path(args.output_dir or ".") / "calibration"
        if self.save_plots and state.is_world_process_zero:
            record.update(self._write_plots(directory, prefix, state.global_step, snapshot))
        self.history.append(record)
        logger.info(
            "Calibration at step %d: %s", state.global_step, ", ".join(f"{k}={v:.4f}" for k, v in logged.items())
        )

    on_predict = on_evaluate  # trainer.predict(): same signature, prefix "test"
