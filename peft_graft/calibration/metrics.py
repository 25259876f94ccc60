"""Pure-function calibration metrics (functional core of :mod:`peft_graft.calibration`).

Every public function accepts predictions as logits or probabilities (numpy array, torch tensor or nested list),
binary or multi-class, plus integer labels, converts them once to ``float64`` torch tensors and returns a Python
``float``. Inputs are checked by the ``_..._arg_validation`` / ``_..._tensor_validation`` helpers, which raise a
``ValueError`` / ``TypeError`` naming the offending argument.

Prediction formats (``input_type``):

* 2-D ``(n, C)`` with ``C >= 2``: ``"logits"`` are soft-maxed; ``"probs"`` must lie in ``[0, 1]`` and each row must
  sum to 1 (within :data:`PROB_SUM_ATOL`); ``"auto"`` reads the array as probabilities when every value is in
  ``[0, 1]`` and as logits otherwise, and raises if the values are in ``[0, 1]`` but the rows do not sum to 1
  (bad probabilities, or logits that happen to lie in ``[0, 1]``: pass ``input_type`` explicitly).
* 1-D ``(n,)``: binary task, one score per example for the *positive* class (label 1). ``"probs"``: ``P(y=1)``;
  ``"logits"``: a logit ``z`` with ``P(y=1) = sigmoid(z)``; ``"auto"``: probabilities if every value is in
  ``[0, 1]``, logits otherwise (the same rule as ``torchmetrics`` and ``sklearn``). A 1-D logit vector whose values
  all fall in ``[0, 1]`` is therefore read as probabilities under ``"auto"``: pass ``input_type="logits"``.
  Internally the score becomes the two-column distribution ``[1 - p, p]``.

Binning (appendix A.3 of Panigrahi et al. 2023, after Guo et al. 2017): ``M`` equal-width bins
``I_m = [(m-1)/M, m/M)``, left-closed as A.3 writes them, with a confidence of exactly ``1.0`` in the last bin.

Default ``M = 15`` (:data:`DEFAULT_N_BINS`). The grafting paper does not state ``M``, and its released code has no
ECE code; A.3 says it uses "the implementation from Guo et al. (2017)", whose reference code
(``_ECELoss`` in github.com/gpleiss/temperature_scaling) defaults to ``n_bins=15``. 15 is therefore the most likely
value behind the paper's ECE numbers, but this is an inference, not a documented fact. It is also the default of
``torchmetrics.CalibrationError``. That reference code uses right-closed bins ``((m-1)/M, m/M]``; the two conventions
differ only for confidences lying exactly on an interior edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "DEFAULT_N_BINS",
    "PROB_SUM_ATOL",
    "ReliabilityBins",
    "accuracy",
    "adaptive_calibration_error",
    "agreement",
    "brier_score",
    "calibration_report",
    "classwise_calibration_error",
    "expected_calibration_error",
    "f1_score",
    "maximum_calibration_error",
    "negative_log_likelihood",
    "reliability_bins",
    "to_probabilities",
    "top_label_confidence",
]

DEFAULT_N_BINS = 15
"""Default number of equal-width bins: the default of Guo et al.'s reference ECE code (see the module docstring)."""

PROB_SUM_ATOL = 1e-4
"""Absolute tolerance on ``|sum_k p_k - 1|`` for probability inputs (generous w.r.t. fp32 soft-max round-off).
For float16/bfloat16 inputs the tolerance is ``max(PROB_SUM_ATOL, 8 * eps(dtype))``."""

NLL_EPS = 1e-12
"""Probabilities are clamped to at least this value before ``log`` in the negative log-likelihood."""

InputType = Literal["auto", "logits", "probs"]
ArrayLike = Any  # numpy array, torch tensor or nested Python sequence
_INPUT_TYPES = ("auto", "logits", "probs")
_BIN_STRATEGIES = ("uniform", "quantile")

REPORT_KEYS = (
    "accuracy",
    "ece",
    "mce",
    "adaptive_ece",
    "classwise_ece",
    "brier",
    "nll",
)


# ----------------------------------------------------------------------------------------------------------------------
# Validation and conversion helpers
# ----------------------------------------------------------------------------------------------------------------------


def _n_bins_arg_validation(n_bins: int) -> None:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"Argument `n_bins` must be an integer >= 1 (e.g. n_bins=10), got {n_bins!r}.")


def _input_type_arg_validation(input_type: str) -> None:
    if input_type not in _INPUT_TYPES:
        raise ValueError(f"Argument `input_type` must be one of {_INPUT_TYPES}, got {input_type!r}.")


def _strategy_arg_validation(strategy: str) -> None:
    if strategy not in _BIN_STRATEGIES:
        raise ValueError(f"Argument `strategy` must be one of {_BIN_STRATEGIES}, got {strategy!r}.")


def _as_tensor(x: ArrayLike, name: str) -> torch.Tensor:
    """Convert numpy / torch / nested sequences to a CPU tensor (no copy for CPU tensors)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            raise TypeError(f"Argument `{name}` has dtype object; pass a numeric numpy array or torch tensor.")
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (Sequence, np.generic)) and not isinstance(x, (str, bytes)):
        try:
            return torch.as_tensor(np.asarray(x))
        except (TypeError, ValueError) as err:
            raise TypeError(f"Argument `{name}` could not be converted to a numeric array: {err}") from None
    raise TypeError(f"Argument `{name}` must be a numpy array, torch tensor or list, got {type(x).__name__}.")


def _preds_tensor_validation(preds: torch.Tensor, name: str) -> None:
    if not (preds.is_floating_point() or preds.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)):
        raise TypeError(f"Argument `{name}` must hold real-valued logits or probabilities, got dtype {preds.dtype}.")
    if preds.ndim not in (1, 2):
        raise ValueError(
            f"Argument `{name}` must have shape (n,) (binary positive-class scores) or (n, num_classes), "
            f"got shape {tuple(preds.shape)}."
        )
    if preds.shape[0] == 0:
        raise ValueError(f"Argument `{name}` is empty; need at least one example.")
    if preds.ndim == 2 and preds.shape[1] < 2:
        raise ValueError(
            f"Argument `{name}` has shape {tuple(preds.shape)}: need at least 2 columns (classes). For a binary task "
            f"with a single score per example pass a 1-D array (e.g. `{name}[:, 0]`) and set `input_type`."
        )
    if not torch.isfinite(preds).all():
        n_bad = int((~torch.isfinite(preds)).sum())
        raise ValueError(f"Argument `{name}` contains {n_bad} NaN or infinite value(s); all values must be finite.")


def _labels_tensor_validation(labels: torch.Tensor, n: int, num_classes: int, name: str = "labels") -> None:
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"Argument `{name}` must hold integer class indices, got dtype {labels.dtype}; cast to int.")
    if labels.ndim != 1:
        raise ValueError(f"Argument `{name}` must be 1-D with shape (n,), got shape {tuple(labels.shape)}.")
    if labels.shape[0] != n:
        raise ValueError(f"Length mismatch: `preds` has {n} examples but `{name}` has {labels.shape[0]}.")
    if n and (labels.min() < 0 or labels.max() >= num_classes):
        bad = labels[(labels < 0) | (labels >= num_classes)][:5].tolist()
        raise ValueError(
            f"Argument `{name}` contains values {bad} outside the valid class range [0, {num_classes - 1}] "
            f"implied by `preds` ({num_classes} classes)."
        )


def _format_preds(preds: ArrayLike, input_type: InputType = "auto", name: str = "preds") -> tuple[torch.Tensor, bool]:
    """Validate predictions and return ``(values, is_logits)`` as a float64 tensor of shape (n,) or (n, C)."""
    _input_type_arg_validation(input_type)
    tensor = _as_tensor(preds, name)
    _preds_tensor_validation(tensor, name)
    if tensor.ndim == 1 and not tensor.is_floating_point():
        raise TypeError(
            f"Argument `{name}` is a 1-D integer array, which looks like predicted class ids; calibration needs "
            f"scores: pass logits or probabilities (as floats)."
        )
    # rows of half-precision probabilities cannot sum to 1 more precisely than a few ulps of their dtype
    tol = max(PROB_SUM_ATOL, 8 * torch.finfo(tensor.dtype).eps) if tensor.is_floating_point() else PROB_SUM_ATOL
    tensor = tensor.to(torch.float64)
    in_unit = bool(((tensor >= 0) & (tensor <= 1)).all())
    if input_type == "logits":
        return tensor, True
    if input_type == "auto" and not in_unit:
        return tensor, True
    # probabilities (explicit, or "auto" with every value in [0, 1])
    if not in_unit:
        raise ValueError(
            f"Argument `{name}` was declared as probabilities (input_type='probs') but has values outside [0, 1] "
            f"(min {tensor.min().item():.4g}, max {tensor.max().item():.4g}); pass input_type='logits'."
        )
    if tensor.ndim == 2:
        sums = tensor.sum(dim=1)
        worst = (sums - 1).abs().max().item()
        if worst > tol:
            hint = "" if input_type == "probs" else " If these are logits, pass input_type='logits'."
            raise ValueError(
                f"Argument `{name}` looks like probabilities but its rows do not sum to 1 (largest deviation "
                f"{worst:.3g} > {tol:.3g}). Normalise each row (e.g. softmax).{hint}"
            )
    return tensor, False


def _log_probabilities(values: torch.Tensor, is_logits: bool, eps: float = 0.0) -> torch.Tensor:
    """(n, C) log-probabilities from formatted values; ``eps`` clamps probabilities before ``log``."""
    if values.ndim == 1:
        if is_logits:  # binary logit z: log p = [log sigmoid(-z), log sigmoid(z)]
            return torch.stack([torch.nn.functional.logsigmoid(-values), torch.nn.functional.logsigmoid(values)], 1)
        values = torch.stack([1 - values, values], dim=1)
    elif is_logits:
        return torch.log_softmax(values, dim=1)
    return values.clamp_min(eps).log()


def _probabilities(values: torch.Tensor, is_logits: bool) -> torch.Tensor:
    if values.ndim == 1:
        p = torch.sigmoid(values) if is_logits else values
        return torch.stack([1 - p, p], dim=1)
    return torch.softmax(values, dim=1) if is_logits else values


def _format_inputs(
    preds: ArrayLike, labels: ArrayLike, input_type: InputType = "auto", preds_name: str = "preds"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate and convert ``(preds, labels)`` to ``(probs (n, C) float64, labels (n,) int64)``."""
    values, is_logits = _format_preds(preds, input_type, preds_name)
    probs = _probabilities(values, is_logits)
    return probs, _format_labels(labels, probs.shape[0], probs.shape[1])


def _format_labels(labels: ArrayLike, n: int, num_classes: int) -> torch.Tensor:
    """Validate labels against ``n`` examples and ``num_classes`` classes; return an int64 tensor."""
    tensor = _as_tensor(labels, "labels")
    if tensor.dtype == torch.bool:
        tensor = tensor.long()
    _labels_tensor_validation(tensor, n, num_classes)
    return tensor.long()


def to_probabilities(preds: ArrayLike, input_type: InputType = "auto") -> torch.Tensor:
    """Convert logits or probabilities to a validated ``(n, C)`` float64 probability tensor.

    Args:
        preds: Logits or probabilities of shape ``(n, C)``, or binary positive-class scores of shape ``(n,)``.
        input_type: ``"logits"``, ``"probs"`` or ``"auto"`` (see the module docstring).

    Returns:
        Tensor of shape ``(n, C)`` (``C = 2`` for 1-D input) whose rows sum to 1.
    """
    values, is_logits = _format_preds(preds, input_type)
    return _probabilities(values, is_logits)


def top_label_confidence(probs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-label confidence ``max_k p_k`` and correctness ``argmax_k p_k == y`` of validated tensors."""
    confidences, predictions = probs.max(dim=1)
    return confidences, predictions.eq(labels)


# ----------------------------------------------------------------------------------------------------------------------
# Binning: the single place where examples are assigned to bins and per-bin statistics are computed
# ----------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReliabilityBins:
    """Per-bin statistics of a reliability diagram.

    Attributes:
        edges: ``(M + 1,)`` bin edges. For equal-width bins ``m / M``; for equal-mass bins the midpoints between the
            extreme confidences of adjacent bins, with 0 and 1 at the ends.
        counts: ``(M,)`` number of examples per bin ``|B_m|``.
        confidence: ``(M,)`` mean confidence ``conf(B_m)`` (0 for empty bins).
        accuracy: ``(M,)`` empirical accuracy ``acc(B_m)`` (0 for empty bins).
    """

    edges: torch.Tensor
    counts: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor

    @property
    def n_bins(self) -> int:
        return int(self.counts.numel())

    @property
    def weights(self) -> torch.Tensor:
        """``|B_m| / n`` per bin."""
        return self.counts / self.counts.sum()

    @property
    def gaps(self) -> torch.Tensor:
        """``|acc(B_m) - conf(B_m)|`` per bin (0 for empty bins)."""
        return (self.accuracy - self.confidence).abs()

    def expected_error(self) -> float:
        """``sum_m |B_m| / n * |acc(B_m) - conf(B_m)|``."""
        return float((self.weights * self.gaps).sum())

    def maximum_error(self) -> float:
        """``max_m |acc(B_m) - conf(B_m)|`` over non-empty bins."""
        return float(self.gaps[self.counts > 0].max())


def _uniform_bin_index(confidences: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-width bins ``[(m-1)/M, m/M)``; a confidence of exactly 1 goes to the last bin."""
    edges = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins
    # right=True: index i such that inner[i-1] <= c < inner[i], i.e. left-closed bins; c >= (M-1)/M -> bin M-1.
    index = torch.bucketize(confidences.to(torch.float64), edges[1:-1], right=True)
    return index, edges


def _equal_mass_bin_index(confidences: torch.Tensor, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-mass bins: sort by confidence, bin ``m`` holds ranks ``[m n / M, (m+1) n / M)`` (sizes differ by <= 1)."""
    n = confidences.numel()
    order = torch.argsort(confidences, stable=True)
    index = torch.empty(n, dtype=torch.int64)
    index[order] = torch.div(torch.arange(n) * n_bins, n, rounding_mode="floor")
    sorted_conf = confidences[order].to(torch.float64)
    sorted_index = index[order]
    edges = torch.zeros(n_bins + 1, dtype=torch.float64)
    edges[-1] = 1.0
    for m in range(1, n_bins):
        lower = sorted_conf[sorted_index < m]
        upper = sorted_conf[sorted_index >= m]
        if lower.numel() and upper.numel():
            edges[m] = (lower[-1] + upper[0]) / 2
        else:
            edges[m] = edges[m - 1]
    return index, edges


def reliability_bins(
    confidences: ArrayLike, correct: ArrayLike, n_bins: int = DEFAULT_N_BINS, strategy: str = "uniform"
) -> ReliabilityBins:
    """Bin ``(confidence, correct)`` pairs and return per-bin counts, mean confidence and accuracy.

    This is the one binning routine behind ECE, MCE, adaptive ECE, classwise ECE and the reliability diagram.

    Args:
        confidences: ``(n,)`` confidences in ``[0, 1]`` (e.g. top-label probabilities).
        correct: ``(n,)`` booleans or 0/1 floats: whether the prediction was right (or, for classwise ECE, whether
            the example belongs to the class).
        n_bins: Number of bins ``M >= 1``.
        strategy: ``"uniform"`` (equal-width bins ``[(m-1)/M, m/M)``, 1.0 in the last bin) or ``"quantile"``
            (equal-mass bins).

    Returns:
        A :class:`ReliabilityBins`.
    """
    _n_bins_arg_validation(n_bins)
    _strategy_arg_validation(strategy)
    conf = _as_tensor(confidences, "confidences").to(torch.float64).reshape(-1).contiguous()
    hits = _as_tensor(correct, "correct").to(torch.float64).reshape(-1)
    if conf.numel() == 0:
        raise ValueError("Argument `confidences` is empty; need at least one example.")
    if conf.numel() != hits.numel():
        raise ValueError(f"Length mismatch: `confidences` has {conf.numel()} values but `correct` has {hits.numel()}.")
    if not torch.isfinite(conf).all() or conf.min() < 0 or conf.max() > 1:
        raise ValueError("Argument `confidences` must contain finite values in [0, 1].")
    n_bins = int(n_bins)
    binner = _uniform_bin_index if strategy == "uniform" else _equal_mass_bin_index
    index, edges = binner(conf, n_bins)
    counts = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, index, torch.ones_like(conf))
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, index, conf)
    hit_sum = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, index, hits)
    safe = counts.clamp_min(1)
    return ReliabilityBins(edges=edges, counts=counts, confidence=conf_sum / safe, accuracy=hit_sum / safe)


def _top_label_bins(
    preds: ArrayLike, labels: ArrayLike, n_bins: int, input_type: InputType, strategy: str
) -> ReliabilityBins:
    _n_bins_arg_validation(n_bins)
    probs, target = _format_inputs(preds, labels, input_type)
    confidences, correct = top_label_confidence(probs, target)
    return reliability_bins(confidences, correct, n_bins, strategy)


# ----------------------------------------------------------------------------------------------------------------------
# Public metrics
# ----------------------------------------------------------------------------------------------------------------------


def expected_calibration_error(
    preds: ArrayLike, labels: ArrayLike, n_bins: int = DEFAULT_N_BINS, input_type: InputType = "auto"
) -> float:
    """Expected calibration error (Guo et al. 2017; Panigrahi et al. 2023, appendix A.3).

    ``ECE = sum_m |B_m| / n * |acc(B_m) - conf(B_m)|`` with top-label confidence and ``M`` equal-width bins
    ``I_m = [(m-1)/M, m/M)``; a confidence of exactly 1 falls in the last bin.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        n_bins: Number of bins ``M`` (default :data:`DEFAULT_N_BINS` = 15, see the module docstring).
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.

    Returns:
        ECE in ``[0, 1]``.
    """
    return _top_label_bins(preds, labels, n_bins, input_type, "uniform").expected_error()


def maximum_calibration_error(
    preds: ArrayLike, labels: ArrayLike, n_bins: int = DEFAULT_N_BINS, input_type: InputType = "auto"
) -> float:
    """Maximum calibration error ``max_m |acc(B_m) - conf(B_m)|`` over non-empty equal-width bins.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        n_bins: Number of bins ``M``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
    """
    return _top_label_bins(preds, labels, n_bins, input_type, "uniform").maximum_error()


def adaptive_calibration_error(
    preds: ArrayLike, labels: ArrayLike, n_bins: int = DEFAULT_N_BINS, input_type: InputType = "auto"
) -> float:
    """Adaptive (equal-mass) ECE: the ECE formula with bins holding ``n / M`` examples each (Nixon et al. 2019).

    Examples are sorted by top-label confidence (stable sort) and example of rank ``r`` goes to bin
    ``floor(r M / n)``; ties may therefore be split across bins.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        n_bins: Number of bins ``M``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
    """
    return _top_label_bins(preds, labels, n_bins, input_type, "quantile").expected_error()


def classwise_calibration_error(
    preds: ArrayLike, labels: ArrayLike, n_bins: int = DEFAULT_N_BINS, input_type: InputType = "auto"
) -> float:
    """Classwise ECE (Kull et al. 2019): mean over classes ``k`` of the ECE of ``p_k`` against ``1[y = k]``.

    For each class, all ``n`` examples are binned by ``p_k`` into the equal-width bins; ``acc(B_m)`` is then the
    fraction of examples of class ``k`` in the bin. Classes absent from ``labels`` still count (their ECE measures
    how much probability the model puts on them).

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        n_bins: Number of bins ``M``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
    """
    _n_bins_arg_validation(n_bins)
    probs, target = _format_inputs(preds, labels, input_type)
    errors = [
        reliability_bins(probs[:, k], target.eq(k), n_bins, "uniform").expected_error() for k in range(probs.shape[1])
    ]
    return float(np.mean(errors))


def brier_score(preds: ArrayLike, labels: ArrayLike, input_type: InputType = "auto") -> float:
    """Multi-class Brier score ``1/n sum_i sum_k (p_ik - 1[y_i = k])^2`` (Brier 1950), in ``[0, 2]``.

    For binary inputs this sums over both classes, i.e. it is twice ``sklearn.metrics.brier_score_loss``.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
    """
    probs, target = _format_inputs(preds, labels, input_type)
    onehot = torch.nn.functional.one_hot(target, probs.shape[1]).to(probs.dtype)
    return float(((probs - onehot) ** 2).sum(dim=1).mean())


def negative_log_likelihood(
    preds: ArrayLike, labels: ArrayLike, input_type: InputType = "auto", eps: float = NLL_EPS
) -> float:
    """Mean negative log-likelihood ``-1/n sum_i log p_{i, y_i}`` (natural log).

    Logits go through ``log_softmax`` (``logsigmoid`` for 1-D logits) for numerical stability; probabilities are
    clamped to at least ``eps`` before the log so a zero probability on the true class gives ``-log(eps)`` instead of
    infinity.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
        eps: Lower clamp for probability inputs.
    """
    values, is_logits = _format_preds(preds, input_type)
    log_probs = _log_probabilities(values, is_logits, eps)
    target = _format_labels(labels, log_probs.shape[0], log_probs.shape[1])
    return float(-log_probs.gather(1, target[:, None]).mean())


def accuracy(preds: ArrayLike, labels: ArrayLike, input_type: InputType = "auto") -> float:
    """Fraction of examples whose argmax prediction equals the label (ties go to the lowest class index)."""
    probs, target = _format_inputs(preds, labels, input_type)
    return float(probs.argmax(dim=1).eq(target).double().mean())


def f1_score(
    preds: ArrayLike,
    labels: ArrayLike,
    average: Literal["binary", "macro"] = "macro",
    input_type: InputType = "auto",
) -> float:
    """F1 score of argmax predictions.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        average: ``"binary"`` (F1 of class 1, as GLUE reports for MRPC/QQP; needs 2 classes) or ``"macro"``
            (unweighted mean over classes; a class with no true and no predicted example scores 0).
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
    """
    if average not in ("binary", "macro"):
        raise ValueError(f"Argument `average` must be 'binary' or 'macro', got {average!r}.")
    probs, target = _format_inputs(preds, labels, input_type)
    num_classes = probs.shape[1]
    if average == "binary" and num_classes != 2:
        raise ValueError(f"average='binary' needs 2 classes but `preds` has {num_classes}; use average='macro'.")
    pred = probs.argmax(dim=1)
    classes = [1] if average == "binary" else range(num_classes)
    scores = []
    for k in classes:
        tp = float(((pred == k) & (target == k)).sum())
        denom = float((pred == k).sum() + (target == k).sum())
        scores.append(2 * tp / denom if denom else 0.0)
    return float(np.mean(scores))


def _predicted_labels(preds: ArrayLike, input_type: InputType, name: str) -> torch.Tensor:
    tensor = _as_tensor(preds, name)
    if tensor.ndim == 1 and not tensor.is_floating_point() and tensor.dtype != torch.bool:
        return tensor.long()  # already class predictions
    values, is_logits = _format_preds(tensor, input_type, name)
    return _probabilities(values, is_logits).argmax(dim=1)


def agreement(preds_a: ArrayLike, preds_b: ArrayLike, input_type: InputType = "auto") -> float:
    """Fraction of examples on which two models' argmax predictions agree (the paper's "Agreement" column).

    Args:
        preds_a: Logits / probabilities of model A (any format accepted by the other metrics), or a 1-D integer array
            of predicted classes.
        preds_b: Same for model B, on the same examples in the same order.
        input_type: Format of float inputs (applied to both).
    """
    a = _predicted_labels(preds_a, input_type, "preds_a")
    b = _predicted_labels(preds_b, input_type, "preds_b")
    if a.numel() != b.numel():
        raise ValueError(f"Length mismatch: `preds_a` has {a.numel()} examples but `preds_b` has {b.numel()}.")
    if a.numel() == 0:
        raise ValueError("Arguments `preds_a` and `preds_b` are empty; need at least one example.")
    return float(a.eq(b).double().mean())


def calibration_report(
    preds: ArrayLike,
    labels: ArrayLike,
    n_bins: int = DEFAULT_N_BINS,
    input_type: InputType = "auto",
    reference_preds: ArrayLike | None = None,
    metrics: Sequence[str] | None = None,
) -> dict[str, float]:
    """All calibration metrics of one set of predictions, as a flat ``dict`` of floats.

    Keys: ``accuracy``, ``ece``, ``mce``, ``adaptive_ece``, ``classwise_ece``, ``brier``, ``nll`` and, when
    ``reference_preds`` is given, ``agreement``.

    Args:
        preds: Logits or probabilities ``(n, C)``, or binary positive-class scores ``(n,)``.
        labels: Integer labels ``(n,)``.
        n_bins: Number of bins for the binned metrics.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
        reference_preds: Optional predictions of a reference model on the same examples, for ``agreement``.
        metrics: Optional subset of the keys above to compute (default: all).
    """
    _n_bins_arg_validation(n_bins)
    wanted = list(REPORT_KEYS) if metrics is None else list(metrics)
    unknown = set(wanted) - set(REPORT_KEYS) - {"agreement"}
    if unknown:
        raise ValueError(f"Argument `metrics` has unknown names {sorted(unknown)}; choose from {REPORT_KEYS}.")
    if "agreement" in wanted and reference_preds is None:
        raise ValueError("Metric 'agreement' needs `reference_preds` (predictions of the reference model).")
    values, is_logits = _format_preds(preds, input_type)
    probs = _probabilities(values, is_logits)
    target = _format_labels(labels, probs.shape[0], probs.shape[1])
    confidences, correct = top_label_confidence(probs, target)
    out: dict[str, float] = {}
    uniform = reliability_bins(confidences, correct, n_bins) if {"ece", "mce"} & set(wanted) else None
    for key in wanted:
        if key == "accuracy":
            out[key] = float(correct.double().mean())
        elif key == "ece":
            out[key] = uniform.expected_error()
        elif key == "mce":
            out[key] = uniform.maximum_error()
        elif key == "adaptive_ece":
            out[key] = reliability_bins(confidences, correct, n_bins, "quantile").expected_error()
        elif key == "classwise_ece":
            out[key] = classwise_calibration_error(probs, target, n_bins, "probs")
        elif key == "brier":
            out[key] = brier_score(probs, target, "probs")
        elif key == "nll":
            out[key] = float(-_log_probabilities(values, is_logits, NLL_EPS).gather(1, target[:, None]).mean())
        # "agreement" is filled in below
    if reference_preds is not None:
        ref = _predicted_labels(reference_preds, input_type, "reference_preds")
        if ref.numel() != target.numel():
            raise ValueError(
                f"Length mismatch: `preds` has {target.numel()} examples but `reference_preds` has {ref.numel()}."
            )
        out["agreement"] = float(probs.argmax(dim=1).eq(ref).double().mean())
    return out
