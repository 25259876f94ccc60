"""Localize-and-Stitch's localizer (He et al., TMLR 2024), written from its equations: a region per task learned with
full-batch steps on real-valued scores ``S``, the alternative to :class:`~peft_graft.MaskTrainer`.

With ``tau = theta_ft - theta_pre`` over the eligible tensors (the encoder layers by default, as the reference code's
``'encoder.layer' in name``):

* **Start.** ``S = +sigmoid_bias`` on the top ``int(sparsity * n)`` entries of ``|tau|`` (over all ``n`` eligible
  entries at once), ``-sigmoid_bias`` elsewhere. Exactly ``int(sparsity * n)`` entries: the reference code's strict
  threshold (``|tau|`` above the k-th largest value) starts with one fewer when the values are distinct.
* **One step = one pass over the training set.** The model is evaluated at ``theta_pre + sigmoid(S) * tau`` (every
  eligible entry, not rounded; dropout off), and the gradients of the batch-mean losses are *summed* over the pass's
  batches (``G``; the reference code accumulates them so: its divisor stays 1). Then, with ``d = sigmoid'(S)``::

      S <- S - lr * (G * tau) * d + l1_strength * sign(S) * d          # sign(0) counts as negative

  The second term is the reference code's "L1" term: it pushes every score away from 0, keeping its sign, so an entry
  leaves or joins the region only when the task gradient outweighs it.
* **Region.** The entries with ``round(sigmoid(S)) = 1``, i.e. ``S > 0``: its size floats, nothing forces a budget.

The reference defaults for language tasks: ``sparsity=1e-5``, ``sigmoid_bias=5``, ``learning_rate=1e7``,
``l1_strength=10``, 10 steps, batch 8. ``exclude`` keeps entries out of the region for good (their ``S`` is ``-inf``),
e.g. the regions of earlier tasks, to learn regions that do not collide.

Only finite values are learned from: NaN or inf in theta_ft, theta_pre or ``tau``, a fine-tune equal to the model
outside ``exclude``, and an ``exclude`` covering every eligible entry are refused (``ValueError``) when the localizer
is made; a step whose loss or gradient is not finite is refused, leaving ``S`` and the model as they were.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from ..regions import Region

ELIGIBLE = r"encoder\.layer\."
"""The reference code's eligible tensors: the transformer layers (not the embeddings, pooler or head)."""


class LocalizeStitch:
    """Learn one task's region by Localize-and-Stitch's localization (see the module docstring).

    Args:
        model: The pre-trained model ``theta_pre`` with the task's (frozen) head; ``model(**batch).loss`` must be the
            task loss. Its eligible parameters are overwritten during :meth:`step` and restored after it.
        finetuned: The fine-tuned model, or its state dict (``theta_ft``; the eligible tensors are read).
        sparsity: Fraction of the eligible entries that start in the region (top of ``|tau|``).
        sigmoid_bias: ``|S|`` at the start.
        learning_rate: Step size on ``S``.
        l1_strength: Strength of the sign-keeping term.
        include: Regex a parameter name must match (``re.search``) to be eligible.
        exclude: Entries never in the region (by parameter name).
    """

    def __init__(
        self,
        model: nn.Module,
        finetuned: nn.Module | Mapping[str, torch.Tensor],
        *,
        sparsity: float = 1e-5,
        sigmoid_bias: float = 5.0,
        learning_rate: float = 1e7,
        l1_strength: float = 10.0,
        include: str = ELIGIBLE,
        exclude: Region | None = None,
    ) -> None:
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity <= 1.0:
            raise ValueError(f"sparsity must be a fraction in [0, 1] of the eligible entries, got {sparsity!r}.")
        for name, value in (("sigmoid_bias", sigmoid_bias), ("learning_rate", learning_rate),
                            ("l1_strength", l1_strength)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        if exclude is not None and not isinstance(exclude, Region):
            raise TypeError(f"exclude must be a Region, got {type(exclude).__name__}.")
        self.model = model
        self.sigmoid_bias, self.learning_rate, self.l1_strength = sigmoid_bias, learning_rate, l1_strength
        state = finetuned.state_dict() if isinstance(finetuned, nn.Module) else finetuned
        pattern = re.compile(include)
        self.params = {name: p for name, p in model.named_parameters() if pattern.search(name)}
        if not self.params:
            raise ValueError(f"No parameter of the model matches include={include!r}: nothing is eligible.")
        self.pre, self.tau, self.scores = {}, {}, {}
        for name, param in self.params.items():
            if name not in state:
                raise ValueError(f"finetuned has no tensor {name!r}: give the fine-tune of this model.")
            if state[name].shape != param.shape:
                raise ValueError(f"finetuned's {name!r} has shape {tuple(state[name].shape)}, the model's "
                                 f"{tuple(param.shape)}: give the fine-tune of this model.")  # fmt: skip
            for source, tensor in (("finetuned", state[name]), ("the model", param)):
                _check_finite(tensor, f"{source}'s {name!r}")
            self.pre[name] = param.detach().clone()
            self.tau[name] = (state[name].detach().to(param) - self.pre[name]).float()
            _check_finite(self.tau[name], f"tau = theta_ft - theta_pre of {name!r} (it overflows {param.dtype})")
        self.excluded = {name: self._excluded(name, exclude) for name in self.params}
        self._check_something_to_learn()
        self._start(sparsity)

    def _check_something_to_learn(self) -> None:
        """Refuse an ``exclude`` that covers every eligible entry, and a fine-tune equal to the model outside it."""
        if all(bool(self.excluded[name].all()) for name in self.params):
            raise ValueError(
                f"exclude covers all {self.num_eligible} eligible entries: no entry could join the region. Exclude "
                "fewer entries (e.g. only earlier tasks' regions), or widen include."
            )
        if not any(bool(((self.tau[n] != 0) & ~self.excluded[n]).any()) for n in self.params):
            raise ValueError(
                "finetuned equals the model on every eligible entry outside exclude (tau = theta_ft - theta_pre is 0): "
                "there is nothing to localize. Give the fine-tuned model (not a copy of the pre-trained one), or "
                "check include and exclude."
            )

    def _excluded(self, name: str, exclude: Region | None) -> torch.Tensor:
        mask = torch.zeros(self.params[name].numel(), dtype=torch.bool)
        if exclude is not None and name in exclude:
            indices = exclude[name]
            if indices.numel() and int(indices[-1]) >= mask.numel():
                raise ValueError(f"exclude holds entry {int(indices[-1])} of {name!r}, which has {mask.numel()}.")
            mask[indices] = True
        return mask.view(self.params[name].shape)

    def _start(self, sparsity: float) -> None:
        """``S = +sigmoid_bias`` on the top ``int(sparsity * n)`` of ``|tau|`` (excluded entries never), else
        ``-sigmoid_bias``; excluded entries ``-inf``."""
        names = list(self.params)
        magnitude = torch.cat([torch.where(self.excluded[n], -1.0, self.tau[n].abs()).reshape(-1) for n in names])
        k = min(int(sparsity * magnitude.numel()), int((magnitude >= 0).sum()))
        chosen = torch.zeros(magnitude.numel(), dtype=torch.bool)
        chosen[torch.topk(magnitude, k).indices] = True
        for name, part in zip(names, chosen.split([self.params[n].numel() for n in names]), strict=True):
            scores = torch.where(part.view(self.params[name].shape), self.sigmoid_bias, -self.sigmoid_bias)
            self.scores[name] = scores.masked_fill(self.excluded[name], -torch.inf).float()

    def step(self, batches: Iterable[Mapping[str, torch.Tensor]], loss_fn: Callable | None = None) -> float:
        """One full-batch step over ``batches`` (one pass over the training set); returns the mean batch loss.

        ``loss_fn(model, batch)`` gives a batch's loss (default ``model(**batch).loss``).
        """
        was_training = self.model.training
        flags = {name: p.requires_grad for name, p in self.model.named_parameters()}
        for name, param in self.model.named_parameters():
            param.requires_grad_(name in self.params)
            param.grad = None
        self.model.eval()  # no dropout, as the reference code
        try:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(self.pre[name] + torch.sigmoid(self.scores[name]) * self.tau[name])
            losses = []
            for index, batch in enumerate(batches):
                loss = loss_fn(self.model, batch) if loss_fn is not None else self.model(**batch).loss
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise ValueError(
                        f"The loss of batch {index} is {value}: the scores S are left as they were. Check that "
                        "batch and the model's outputs (a loss that is not finite would make every score NaN)."
                    )
                loss.backward()  # gradients add up over the pass
                losses.append(value)
            if not losses:
                raise ValueError("batches is empty: a step needs at least one batch of the training set.")
            with torch.no_grad():
                updates = {name: self._updated(name, param.grad) for name, param in self.params.items()}
            self.scores.update(updates)  # all or nothing: every tensor was checked
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(self.pre[name])
                    param.grad = None
            for name, param in self.model.named_parameters():
                param.requires_grad_(flags[name])
            self.model.train(was_training)
        return sum(losses) / len(losses)

    def _updated(self, name: str, grad: torch.Tensor | None) -> torch.Tensor:
        """The scores of tensor ``name`` after a step with the summed gradient ``grad``; a ``ValueError`` if it or the
        new scores hold NaN (S unchanged then)."""
        grad = grad if grad is not None else torch.zeros_like(self.params[name])
        _check_finite(grad, f"the gradient of {name!r} (summed over the step's batches)")
        scores = self.scores[name]
        sigmoid = torch.sigmoid(scores)
        slope = sigmoid * (1 - sigmoid)
        task = self.learning_rate * grad.float() * self.tau[name] * slope
        keep_sign = self.l1_strength * torch.where(scores > 0, slope, -slope)
        updated = (scores - task + keep_sign).masked_fill(self.excluded[name], -torch.inf)
        if bool(torch.isnan(updated).any()):
            raise ValueError(
                f"The step makes scores of {name!r} NaN (learning_rate={self.learning_rate} times its gradient "
                "overflows): the scores S are left as they were. Lower learning_rate."
            )
        return updated

    def train(self, batches: Iterable[Mapping[str, torch.Tensor]], steps: int, loss_fn: Callable | None = None) -> list:
        """``steps`` full-batch steps (``batches`` is iterated once per step); returns ``(loss, region size)`` per
        step."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}.")
        batches = list(batches)
        return [(self.step(batches, loss_fn), self.region().num_entries) for _ in range(steps)]

    def region(self) -> Region:
        """The entries with ``round(sigmoid(S)) = 1`` (``S > 0``)."""
        return Region.from_masks({name: scores > 0 for name, scores in self.scores.items()})

    @property
    def num_eligible(self) -> int:
        return sum(p.numel() for p in self.params.values())


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    """A ``ValueError`` naming ``what`` if ``tensor`` holds NaN or inf: one would make every score NaN and the region
    empty."""
    bad = ~torch.isfinite(tensor.detach())
    if bool(bad.any()):
        first = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(
            f"{what} holds {int(bad.sum())} NaN or inf entries (e.g. flat index {first}: "
            f"{float(tensor.detach().reshape(-1)[first])}): a region cannot be learned from it, one would make every "
            "score NaN. Give finite values (the fine-tune of this model, trained without overflow)."
        )


__all__ = ["ELIGIBLE", "LocalizeStitch"]
