"""Which evaluated mask ``MaskTrainer`` keeps when a learned mask must beat gamma_base by more than chance.

Keeping the best of m evaluated masks by accuracy on a few hundred examples also keeps noise: a mask can gain 3 points
there and none on held-out data. With ``selection_alpha`` a learned mask replaces the starting mask (gamma_base) only
if it is more accurate on the selection examples with a one-sided exact sign test (McNemar's test on the examples one
mask gets right and the other wrong) at level ``alpha / m``, Bonferroni over the m learned masks evaluated. Among
those that pass, the best selection metric wins (the earlier on ties); if none passes, gamma_base stays. Whether kept
or not, the best learned mask by the selection metric (the one ``selection_alpha=None`` would keep) is recorded with
its p-value (:attr:`SignificantSelection.best_learned`), so a run shows how far the learned masks were from passing.

Hand-written: the exact binomial tail is a few lines of ``torch.lgamma``, and scipy is not a dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

Entries = dict[str, tuple[torch.Tensor, torch.Tensor]]


def per_example_correct(predictions: np.ndarray | tuple | None, label_ids: np.ndarray | tuple | None) -> np.ndarray:
    """Whether each example is predicted right: ``argmax`` of class logits ``(n, classes)``, or predicted ids ``(n,)``,
    against one label per example."""
    if isinstance(predictions, (tuple, list)):
        predictions = predictions[0]  # the logits, as compute_metrics sees them first
    if isinstance(label_ids, (tuple, list)):
        label_ids = label_ids[0]
    if predictions is None or label_ids is None:
        raise ValueError(
            "selection_alpha compares masks example by example, but the evaluation returned no predictions or no "
            "labels: pass compute_metrics (so that predictions are kept) and labelled eval examples, or set "
            "selection_alpha=None."
        )
    predictions, label_ids = np.asarray(predictions), np.asarray(label_ids)
    if label_ids.ndim != 1:
        raise ValueError(
            f"selection_alpha needs one label per example (sequence classification or a label-word prompt head), got "
            f"labels of shape {label_ids.shape}: set selection_alpha=None for token-level tasks."
        )
    if predictions.shape == label_ids.shape and np.issubdtype(predictions.dtype, np.integer):
        predicted = predictions
    elif predictions.ndim == 2 and predictions.shape[0] == label_ids.shape[0] and predictions.shape[1] > 1:
        predicted = predictions.argmax(-1)
    else:
        raise ValueError(
            f"selection_alpha needs class logits of shape (examples, classes) or predicted class ids of shape "
            f"(examples,), got predictions of shape {predictions.shape} ({predictions.dtype}) for "
            f"{label_ids.shape[0]} labels: return one logit per class, or set selection_alpha=None."
        )
    return predicted == label_ids


def sign_test_p_value(wins: int, losses: int) -> float:
    """One-sided exact sign test: ``P(X >= wins)`` for ``X ~ Binomial(wins + losses, 1/2)`` (1 when both are 0)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = torch.arange(wins, n + 1, dtype=torch.float64)
    log_pmf = math.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1) - n * math.log(2.0)
    return min(1.0, float(torch.logsumexp(log_pmf, 0).exp()))


@dataclass
class Candidate:
    value: float
    step: int
    p_value: float
    entries: Entries


class SignificantSelection:
    """The starting mask, and the learned masks that beat it significantly (see the module docstring).

    Args:
        alpha: Family-wise level: the chance that a learned mask no more accurate than gamma_base replaces it.
        greater_is_better: Direction of the selection metric that ranks the masks that pass.
    """

    def __init__(self, alpha: float, greater_is_better: bool) -> None:
        self.alpha = alpha
        self.greater_is_better = greater_is_better
        self.reference: np.ndarray | None = None
        self.start: Candidate | None = None
        self.candidates: list[Candidate] = []
        self.best_learned: Candidate | None = None  # best selection metric among the learned masks (its entries: {})
        self.evaluated = 0  # learned masks compared with the start (the m of the Bonferroni correction)

    def offer(self, value: float, step: int, correct: np.ndarray, entries: Entries) -> None:
        """Record an evaluated mask; the first one offered is the starting mask (gamma_base)."""
        if self.reference is None:
            self.reference, self.start = correct, Candidate(value, step, 1.0, copy_entries(entries))
            return
        if correct.shape != self.reference.shape:
            raise ValueError(
                f"The selection data changed between evaluations ({self.reference.shape[0]} examples, now "
                f"{correct.shape[0]}): selection_alpha compares every mask on the same examples."
            )
        self.evaluated += 1
        wins = int((correct & ~self.reference).sum())
        losses = int((self.reference & ~correct).sum())
        p_value = sign_test_p_value(wins, losses)
        sign = 1.0 if self.greater_is_better else -1.0
        if self.best_learned is None or sign * value > sign * self.best_learned.value:  # ties: the earlier
            self.best_learned = Candidate(value, step, p_value, {})
        if p_value <= self.alpha:  # the Bonferroni bound only grows, so others can never pass
            self.candidates.append(Candidate(value, step, p_value, copy_entries(entries)))

    def choice(self) -> Candidate | None:
        """The best learned mask whose p-value passes ``alpha / m``, else the starting mask (``None``: none seen)."""
        passing = [c for c in self.candidates if c.p_value * self.evaluated <= self.alpha]
        if not passing:
            return self.start
        sign = 1.0 if self.greater_is_better else -1.0
        return max(passing, key=lambda c: (sign * c.value, -c.step))


def region_change(start: Entries, kept: Entries) -> dict[str, float]:
    """How far the kept region moved from the starting one, over the entries of every module:
    ``entries_changed_from_start``, the size of their symmetric difference (entries dropped plus entries added), and
    ``iou_with_start``, their intersection over union (1.0: the same region; 1.0 too when both are empty)."""
    common = union = 0
    for module in start.keys() | kept.keys():
        a = start[module][0] if module in start else torch.empty(0, dtype=torch.long)
        b = kept[module][0] if module in kept else torch.empty(0, dtype=torch.long)
        shared = int(torch.isin(a, b).sum())
        common += shared
        union += int(a.numel()) + int(b.numel()) - shared
    return {"entries_changed_from_start": union - common, "iou_with_start": common / union if union else 1.0}


def copy_entries(entries: Entries) -> Entries:
    """A copy of a hard region's ``(flat indices, values)`` by module, detached from the learning state."""
    return {module: (idx.detach().clone(), val.detach().clone()) for module, (idx, val) in entries.items()}
