"""Temperature scaling (Guo et al. 2017): the post-hoc calibration baseline to compare grafting against."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from .metrics import ArrayLike, InputType, _format_labels, _format_preds, _log_probabilities, _preds_tensor_validation

__all__ = ["TemperatureScaler", "fit_temperature"]

logger = logging.getLogger(__name__)

MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 1e2


@dataclass(frozen=True)
class TemperatureScaler:
    """A fitted temperature ``T > 0``; calibrated probabilities are ``softmax(logits / T)``.

    Attributes:
        temperature: The temperature ``T``.
        nll_before: Held-out NLL at ``T = 1`` (``None`` if not fitted).
        nll_after: Held-out NLL at the fitted ``T`` (``None`` if not fitted).
    """

    temperature: float
    nll_before: float | None = None
    nll_after: float | None = None

    def __post_init__(self) -> None:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0
        ):
            raise ValueError(f"Argument `temperature` must be a finite number > 0, got {self.temperature!r}.")

    def scale_logits(self, logits: ArrayLike) -> ArrayLike:
        """Return ``logits / T`` with the same shape, dtype and container type (numpy in, numpy out)."""
        if isinstance(logits, torch.Tensor):
            _preds_tensor_validation(logits, "logits")
            return logits / self.temperature
        array = np.asarray(logits)
        _preds_tensor_validation(torch.as_tensor(array), "logits")
        return array / np.asarray(self.temperature, dtype=array.dtype if array.dtype.kind == "f" else np.float64)

    def calibrate(self, preds: ArrayLike, input_type: InputType = "auto") -> ArrayLike:
        """Temperature-scaled probabilities ``(n, C)`` (``C = 2`` for 1-D binary input).

        Probabilities are accepted too: ``softmax(log(p) / T)``, which equals scaling the logits they came from.
        The result is a torch tensor for torch input and a numpy ``float64`` array otherwise.
        """
        values, is_logits = _format_preds(preds, input_type)
        probs = torch.softmax(_scalable_logits(values, is_logits) / self.temperature, dim=1)
        return probs if isinstance(preds, torch.Tensor) else probs.numpy()


def _scalable_logits(values: torch.Tensor, is_logits: bool) -> torch.Tensor:
    """(n, C) logits whose soft-max is the prediction: logits as is, log-probabilities otherwise."""
    if is_logits and values.ndim == 2:
        return values
    return _log_probabilities(values, is_logits, eps=torch.finfo(torch.float64).tiny)


def fit_temperature(
    logits: ArrayLike,
    labels: ArrayLike,
    input_type: InputType = "auto",
    max_iter: int = 100,
) -> TemperatureScaler:
    """Fit a single temperature ``T > 0`` minimising the NLL of ``softmax(logits / T)`` on held-out data.

    Optimises ``log T`` with L-BFGS (strong-Wolfe line search) in float64, starting from ``T = 1``; ``T`` is kept in
    ``[1e-2, 1e2]`` (a warning is logged if it ends on a bound, e.g. for perfectly separable held-out data).

    Args:
        logits: Held-out logits ``(n, C)`` or binary logits ``(n,)``. Probabilities are accepted (their logarithm is
            used as logits).
        labels: Integer labels ``(n,)``.
        input_type: ``"auto"``, ``"logits"`` or ``"probs"``.
        max_iter: Maximum number of L-BFGS iterations.

    Returns:
        A :class:`TemperatureScaler`.
    """
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"Argument `max_iter` must be a positive integer, got {max_iter!r}.")
    values, is_logits = _format_preds(logits, input_type, "logits")
    z = _scalable_logits(values, is_logits)
    target = _format_labels(labels, z.shape[0], z.shape[1])
    bounds = (math.log(MIN_TEMPERATURE), math.log(MAX_TEMPERATURE))
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def nll(current: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(z / current.clamp(*bounds).exp(), target)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nll(log_t)
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        final = log_t.clamp(*bounds)
        temperature = float(final.exp())
        before, after = float(nll(torch.zeros((), dtype=torch.float64))), float(nll(final))
    if not math.isfinite(temperature):
        raise RuntimeError("Temperature fitting diverged; check that `logits` are finite and `labels` are correct.")
    if final.item() in bounds:
        logger.warning(
            "Fitted temperature %.4g hit the allowed range [%g, %g].", temperature, MIN_TEMPERATURE, MAX_TEMPERATURE
        )
    logger.info("Temperature scaling: T=%.4f, NLL %.4f -> %.4f", temperature, before, after)
    return TemperatureScaler(temperature=temperature, nll_before=before, nll_after=after)
