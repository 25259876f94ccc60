"""Calibration and out-of-distribution evaluation for fine-tuned models and their grafts.

Functional core in :mod:`.metrics` (pure functions over logits/probabilities and labels), temperature scaling in
:mod:`.temperature`, matplotlib figures in :mod:`.plots`, ``Trainer`` integration in :mod:`.callbacks` and the
multi-model / multi-dataset table in :mod:`.table`. The ``evaluate`` module lives in ``peft_graft/metrics/calibration``:
``evaluate.load(EVALUATE_MODULE_PATH)``.
"""

from pathlib import Path

from .callbacks import CalibrationCallback, CalibrationMetrics, EvalSnapshot, make_compute_metrics
from .metrics import (
    DEFAULT_N_BINS,
    PROB_SUM_ATOL,
    ReliabilityBins,
    accuracy,
    adaptive_calibration_error,
    agreement,
    brier_score,
    calibration_report,
    classwise_calibration_error,
    expected_calibration_error,
    f1_score,
    maximum_calibration_error,
    negative_log_likelihood,
    reliability_bins,
    to_probabilities,
    top_label_confidence,
)
from .plots import confidence_histogram, reliability_diagram, save_figure
from .table import DEFAULT_TABLE_METRICS, CalibrationTable, calibration_table, print_table
from .temperature import TemperatureScaler, fit_temperature

EVALUATE_MODULE_PATH = str(Path(__file__).resolve().parent.parent / "metrics" / "calibration")
"""Directory of the ``evaluate`` metric module (ECE and friends): ``evaluate.load(EVALUATE_MODULE_PATH)``."""

__all__ = [
    "DEFAULT_N_BINS",
    "DEFAULT_TABLE_METRICS",
    "EVALUATE_MODULE_PATH",
    "PROB_SUM_ATOL",
    "CalibrationCallback",
    "CalibrationMetrics",
    "CalibrationTable",
    "EvalSnapshot",
    "ReliabilityBins",
    "TemperatureScaler",
    "accuracy",
    "adaptive_calibration_error",
    "agreement",
    "brier_score",
    "calibration_report",
    "calibration_table",
    "classwise_calibration_error",
    "confidence_histogram",
    "expected_calibration_error",
    "f1_score",
    "fit_temperature",
    "make_compute_metrics",
    "maximum_calibration_error",
    "negative_log_likelihood",
    "print_table",
    "reliability_bins",
    "reliability_diagram",
    "save_figure",
    "to_probabilities",
    "top_label_confidence",
]
