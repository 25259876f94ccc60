"""Fine-tuning that keeps skills localized: an L1 penalty on the movement ``|theta - theta_pre|`` (paper Figure 5).

With AdamW, fine-tuning spreads its changes over many parameters and sparse grafts stop working; adding
``strength * sum_i |theta_i - theta_pre_i|`` to the loss (the paper uses ``strength = 1e-3``) restores localization.

* :class:`MovementL1Penalty` is the penalty itself, a loss term: it snapshots ``theta_pre`` of the trainable parameters
  and returns the penalty as a differentiable scalar. Use it in any training loop.
* :class:`MovementL1Trainer` is a ``transformers.Trainer`` that adds it to every training loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from .losses import LossTermsTrainer

__all__ = ["MovementL1Penalty", "MovementL1Trainer"]


class MovementL1Penalty:
    """``strength * sum_i |theta_i - theta_pre_i|`` over the parameters that require grad.

    ``theta_pre`` is copied when the penalty is created, so create it before the first optimizer step. Parameters are
    tracked by identity, so the penalty follows them through wrappers (``PeftModel``, ``DataParallel``, accelerate).

    Args:
        model: The model about to be fine-tuned (its current values are ``theta_pre``).
        strength: The coefficient ``lambda >= 0``; the paper uses 1e-3 with AdamW.
        parameters: Optional names of the parameters to penalize; default: every parameter with ``requires_grad``.
    """

    name = "movement_l1"

    def __init__(self, model: nn.Module, strength: float, parameters: Iterable[str] | None = None) -> None:
        if isinstance(strength, bool) or not isinstance(strength, (int, float)):
            raise TypeError(f"strength must be a float, got {type(strength).__name__}.")
        if not 0 <= strength < math.inf:
            raise ValueError(f"strength must be finite and >= 0, got {strength}: e.g. 1e-3 as in the paper's Figure 5.")
        named = dict(model.named_parameters())
        if parameters is None:
            names = [n for n, p in named.items() if p.requires_grad]
        else:
            names = list(parameters)
            unknown = [n for n in names if n not in named]
            if unknown:
                raise ValueError(f"parameters names {unknown[:5]} are not parameters of the model.")
        if not names:
            raise ValueError("The model has no parameter that requires grad: nothing to penalize.")
        self.strength = float(strength)
        self.names = names
        self._pairs = [(named[n], named[n].detach().clone()) for n in names]

    def movement(self) -> torch.Tensor:
        """The differentiable L1 movement ``sum_i |theta_i - theta_pre_i|`` (without the strength)."""
        total = None
        for param, reference in self._pairs:
            term = (param - reference.to(param.device, param.dtype)).abs().sum()
            total = term if total is None else total + term.to(total.device)
        return total

    def __call__(self) -> torch.Tensor:
        """The penalty ``strength * movement()`` as a differentiable scalar."""
        return self.strength * self.movement()


class MovementL1Trainer(LossTermsTrainer):
    """A ``Trainer`` adding ``movement_l1 * sum_i |theta_i - theta_pre_i|`` to the training loss.

    ``theta_pre`` is the model as given to the trainer. With ``movement_l1=0`` it is a plain ``Trainer``. The penalty
    is logged as ``movement_l1`` (its last value is ``trainer.last_loss_terms["movement_l1"]``).

    Args:
        movement_l1: Strength ``lambda >= 0`` of the penalty (the paper uses 1e-3 with AdamW).
        *args, **kwargs: As for ``transformers.Trainer``.
    """

    def __init__(self, *args, movement_l1: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.movement_penalty = MovementL1Penalty(self.model, movement_l1) if movement_l1 else None
        if self.movement_penalty is not None:
            self.loss_terms.append(self.movement_penalty)
