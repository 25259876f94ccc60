"""Per-entry scores from two checkpoints: the movement ``theta_ft - theta_pre`` of every eligible tensor, checked.

The movement is the paper's score for ``gamma_base`` (top-k of ``|theta_ft - theta_pre|``) and the ``delta`` a graft
stores on its region.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import torch
from torch import nn

from ..parameter_layout import Layout


def load_finetuned(source: object, base_model: nn.Module) -> Mapping[str, torch.Tensor]:
    """theta_ft as a state dict, from a model object, a local path or Hub id, or a state dict."""
    if isinstance(source, nn.Module):
        _check_architecture(source, base_model)
        return source.state_dict()
    if isinstance(source, (str, os.PathLike)):
        model_cls = type(base_model)
        if not hasattr(model_cls, "from_pretrained"):
            raise TypeError(
                f"finetuned={source!r} is a path, but the base model {model_cls.__name__} has no from_pretrained: "
                "pass the fine-tuned model object or its state dict instead."
            )
        try:
            finetuned = model_cls.from_pretrained(os.fspath(source), dtype=torch.float32)
        except OSError as error:
            raise ValueError(f"Cannot load the fine-tuned model finetuned={source!r}: {error}") from error
        _check_architecture(finetuned, base_model)
        return finetuned.state_dict()
    if isinstance(source, Mapping):
        return source
    raise TypeError(
        f"finetuned must be a model, a path or Hub id, or a state dict; got {type(source).__name__}. Pass it as "
        "GraftConfig(finetuned=...)."
    )


def _check_architecture(finetuned: nn.Module, base_model: nn.Module) -> None:
    base_type = getattr(getattr(base_model, "config", None), "model_type", None)
    ft_type = getattr(getattr(finetuned, "config", None), "model_type", None)
    if base_type and ft_type and base_type != ft_type:
        raise ValueError(
            f"finetuned is a {ft_type!r} model but the pre-trained model is {base_type!r}: a graft needs theta_ft "
            "fine-tuned from this very pre-trained model."
        )


def _as_patterns(patterns: list[str] | str | None) -> list[re.Pattern]:
    if patterns is None:
        return []
    return [re.compile(p) for p in ([patterns] if isinstance(patterns, str) else patterns)]


def is_saved_whole(name: str, modules_to_save: list[str] | None) -> bool:
    """Whether the tensor ``name`` belongs to a module in ``modules_to_save`` (peft's suffix matching)."""
    module = name.rpartition(".")[0]
    return any(module == m or module.endswith(f".{m}") or module.startswith(f"{m}.") for m in modules_to_save or ())


def eligible_tensors(
    layout: Layout,
    include: list[str] | str | None = None,
    exclude: list[str] | str | None = None,
    modules_to_save: list[str] | None = None,
) -> list[str]:
    """Names of the floating-point tensors that pass the name filters and are not saved whole (before ``only_moved``).

    ``include``/``exclude``: regexes (``GraftConfig.include_parameters``/``exclude_parameters``) searched in every
    name of a tensor.
    """
    include, exclude = _as_patterns(include), _as_patterns(exclude)
    names = []
    for name, info in layout.tensors.items():
        if not info.parameter.is_floating_point():
            continue
        if any(is_saved_whole(alias, modules_to_save) for alias in info.aliases):
            continue
        if include and not any(p.search(a) for p in include for a in info.aliases):
            continue
        if exclude and any(p.search(a) for p in exclude for a in info.aliases):
            continue
        names.append(name)
    return names


def finetuned_tensor(state: Mapping[str, torch.Tensor], layout: Layout, name: str) -> torch.Tensor:
    """theta_ft of the tensor ``name``, found under any of its aliases, shape-checked."""
    info = layout.tensors[name]
    tensor = next((state[a] for a in info.aliases if a in state), None)
    if tensor is None:
        raise ValueError(
            f"The fine-tuned model has no tensor {name!r} (aliases {list(info.aliases)}): is it fine-tuned from "
            "this pre-trained model?"
        )
    if tuple(tensor.shape) != tuple(info.parameter.shape):
        raise ValueError(
            f"Tensor {name!r} has shape {tuple(tensor.shape)} in the fine-tuned model but "
            f"{tuple(info.parameter.shape)} in the pre-trained model."
        )
    return tensor


def compute_movement(
    state: Mapping[str, torch.Tensor], layout: Layout, names: list[str], only_moved: bool
) -> dict[str, torch.Tensor]:
    """``theta_ft - theta_pre`` in fp32 for each tensor in ``names`` (see :func:`exact_movement`)."""
    return exact_movement(state, layout, names, only_moved)[0]


def exact_movement(
    state: Mapping[str, torch.Tensor], layout: Layout, names: list[str], only_moved: bool
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The movement ``theta_ft - theta_pre`` (fp32) of each tensor in ``names``, and what no fp32 delta reproduces.

    Each delta is that of :func:`exact_delta`: ``(theta_pre.float() + delta).to(dtype)`` is ``theta_ft`` bit for bit
    wherever an fp32 delta can give it. The second dict holds, per tensor, the sorted flat indices where none can
    (typically entries that fine-tuning shrank towards 0, whose delta is far larger than their value) and theta_ft
    there as fp32. Unmoved tensors are dropped if ``only_moved``.
    """
    movement, unreachable = {}, {}
    for name in names:
        pre = layout.tensors[name].parameter.detach()
        finetuned = finetuned_tensor(state, layout, name).detach().to(pre.device)
        delta, missed = exact_delta(pre, finetuned)
        low, high = torch.aminmax(delta)  # one pass: both are 0 only if nothing moved
        if not (torch.isfinite(low) and torch.isfinite(high)):
            bad = (~torch.isfinite(delta)).sum().item()
            raise ValueError(f"theta_ft - theta_pre has {bad} NaN or inf entries in tensor {name!r}.")
        if only_moved and low == 0 and high == 0 and not missed.any():
            continue
        movement[name] = delta
        if missed.any():
            flat = missed.reshape(-1).nonzero().reshape(-1)
            unreachable[name] = (flat, finetuned.to(pre.dtype).reshape(-1)[flat].float())
    return movement, unreachable


def exact_delta(pre: torch.Tensor, finetuned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``d`` with ``(pre.float() + d).to(pre.dtype) == finetuned.to(pre.dtype)`` bit for bit where one exists,
    and the boolean mask of the entries where none does.

    ``finetuned - pre`` rounded to fp32 almost always works; a miss of the sum's rounding is repaired by stepping ``d``
    an ulp towards the target. No fp32 ``d`` exists where ``|d|`` is so much larger than the target that fp32 steps of
    ``d`` are coarser than the target's own: e.g. a weight that fine-tuning shrank to a thousandth of its value.
    """
    target = finetuned.to(pre.dtype)
    base = pre.float()
    rounded = delta = finetuned.float() - base
    applied = (base + delta).to(pre.dtype)
    wrong = applied != target
    for _ in range(4):
        if not wrong.any():
            break
        direction = torch.where(applied < target, torch.inf, -torch.inf)
        delta = torch.where(wrong, torch.nextafter(delta, direction), delta)
        applied = (base + delta).to(pre.dtype)
        wrong = applied != target
    if wrong.any():  # keep the plain rounded delta there: the closest an additive graft gets
        delta = torch.where(wrong, rounded, delta)
    return delta, wrong
