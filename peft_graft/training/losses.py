"""Loss terms: regularisers added to a ``Trainer``'s training loss once per optimizer step.

A loss term is any object with a ``name`` and a ``__call__()`` returning a differentiable scalar (it holds what it
needs, e.g. the parameters it penalizes). :class:`LossTermsTrainer` adds every term to the training loss, so that a
term counts exactly once per optimizer step whatever the gradient accumulation and however the Trainer scales the
task loss, and logs each term's last value under its name. ``MaskTrainer`` (L1 on ``sigmoid(S)``) and
``MovementL1Trainer`` (L1 on ``|theta - theta_pre|``) both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers import Trainer


@runtime_checkable
class LossTerm(Protocol):
    """A regulariser: ``term()`` is its differentiable value, logged as ``term.name``."""

    name: str

    def __call__(self) -> torch.Tensor: ...


class LossTermsTrainer(Trainer):
    """A ``Trainer`` that adds ``loss_terms`` to every training loss (never to evaluation losses).

    Args:
        loss_terms: The terms to add; more can be appended to ``trainer.loss_terms`` before training.
        *args, **kwargs: As for ``transformers.Trainer``.
    """

    def __init__(self, *args, loss_terms: Sequence[LossTerm] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for term in loss_terms:
            if not isinstance(term, LossTerm):
                raise TypeError(f"loss_terms must have a name and be callable, got {type(term).__name__}.")
        self.loss_terms: list[LossTerm] = list(loss_terms)
        self.last_loss_terms: dict[str, float] = {}
        self._in_training_step = False

    def training_step(self, *args, **kwargs):
        self._in_training_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_training_step = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if not self.loss_terms or not self._in_training_step:
            return result
        loss, outputs = result if return_outputs else (result, None)
        total = loss.new_zeros(())
        for term in self.loss_terms:
            value = term()
            self.last_loss_terms[term.name] = float(value.detach())
            total = total + value.to(loss.device)
        if self.loss_scaled_for_accumulation(num_items_in_batch):
            # training_step will not divide this loss by the accumulation steps: spread the terms over them here.
            total = total / self.current_gradient_accumulation_steps
        loss = loss + total
        return (loss, outputs) if return_outputs else loss

    def loss_scaled_for_accumulation(self, num_items_in_batch) -> bool:
        """Whether ``Trainer.training_step`` takes the loss as already scaled for gradient accumulation (its rule)."""
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool(
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None
        )

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            logs.update(self.last_loss_terms)
        super().log(logs, *args, **kwargs)
