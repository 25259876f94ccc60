"""Input statistics of a model's linear layers, for the merge rules that need data (RegMean).

Kept beside the tuner, not in it: a graft stores parameters only; statistics of a task's inputs are computed from a
model and its data when a rule asks for them, and passed to :func:`peft_graft.merging.merge_grafts` (``grams=``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from peft import PeftModel
from torch import nn

from .tuner.layer import GraftLayer


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules whose inputs RegMean needs, by the name the merge uses: in a graft ``PeftModel``, its graft layers
    over an ``nn.Linear`` (named as :meth:`GraftModel.graft_layers` names them); in any other model, its ``nn.Linear``
    modules."""
    tuner = getattr(model, "base_model", None) if isinstance(model, PeftModel) else None
    if tuner is not None and hasattr(tuner, "graft_layers"):
        return {n: m for n, m in tuner.graft_layers().items() if isinstance(m.base_layer, nn.Linear)}
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, GraftLayer)}


def input_grams(
    model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], max_examples: int | None = None
) -> dict[str, torch.Tensor]:
    """Per linear layer (:func:`linear_layers`): the Gram matrix ``X^T X / n`` of its inputs ``X`` (``n`` rows: every
    position of every example, padding included, as RegMean's reference takes them), in float32, from forward hooks on
    ``model(**batch)`` for each batch (in eval mode, no gradients; each module's mode restored after). With
    ``max_examples``, batches stop once that many examples have run (checked before each batch, as the reference does:
    the last batch may overshoot). For RegMean, run it once per task with that task's graft active and a few hundred of
    its unlabelled inputs."""
    if max_examples is not None and (isinstance(max_examples, bool) or not isinstance(max_examples, int)
                                     or max_examples < 1):  # fmt: skip
        raise ValueError(f"max_examples must be a positive int or None, got {max_examples!r}.")
    layers = linear_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no linear layer to collect input statistics of.")
    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = dict.fromkeys(layers, 0)

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple, output: object) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            rows[name] += x.shape[0]

        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    modes = {module: module.training for module in model.modules()}
    model.eval()  # no dropout: the inputs as the merged model sees them, the same on every run
    examples = 0
    try:
        with torch.no_grad():
            for batch in batches:
                if max_examples is not None and examples >= max_examples:
                    break
                if not isinstance(batch, Mapping):
                    raise TypeError(f"batches must yield dicts of model inputs, got {type(batch).__name__}.")
                model(**batch)
                examples += len(next(iter(batch.values())))
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    if not sums:
        raise ValueError("input_grams ran no batch through a linear layer: give at least one batch of inputs.")
    return {name: (total / rows[name]).float().cpu() for name, total in sums.items()}


__all__ = ["input_grams", "linear_layers"]
