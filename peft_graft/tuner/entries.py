"""A tensor's sparse entries of one graft, and the values grafting them gives (shared by the forward, the in-place
inference and merging)."""

from __future__ import annotations

import torch

from ..parameter_layout import FlatIndexSpace

SparseEntries = tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
"""``(local flat indices, fp32 deltas, (positions among them, theta_ft there))`` of one tensor."""


def entries_of(
    space: FlatIndexSpace,
    indices: torch.Tensor,
    values: torch.Tensor,
    exact: tuple[torch.Tensor, torch.Tensor],
    attr: str,
) -> SparseEntries | None:
    """The entries of the sorted flat ``indices`` that fall in tensor ``attr``, or ``None``; ``exact`` holds positions
    among all ``indices``."""
    for name, local, position in space.split(indices):
        if name == attr:
            positions, targets = exact
            if positions.numel():
                inside = (positions >= position.start) & (positions < position.stop)
                exact = (positions[inside].to(torch.int64) - position.start, targets[inside])
            return local, values[position], exact
    return None


def check_entries(indices: object, values: object, size: int, where: str) -> None:
    """Refuse a hard region that is not sorted distinct int32/int64 flat ``indices`` into ``[0, size)`` with as many
    finite floating-point ``values``; ``where`` names it in the error."""
    if not (torch.is_tensor(indices) and torch.is_tensor(values)):
        kinds = f"{type(indices).__name__} and {type(values).__name__}"
        raise TypeError(f"{where}: indices and values must be tensors, got {kinds}.")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        got = f"{indices.dtype} {tuple(indices.shape)}"
        raise ValueError(f"{where}: indices must be a 1-D int32/int64 tensor, got {got}.")
    if not values.is_floating_point() or values.shape != indices.shape:
        got = f"{values.dtype} {tuple(values.shape)}"
        raise ValueError(f"{where}: values must be floating point, one per index ({indices.numel()}), got {got}.")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise ValueError(f"{where}: indices out of range [0, {size}).")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"{where}: indices must be strictly increasing (sorted, without repeats).")
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{where}: values hold NaN or inf.")


def graft_entries(current: torch.Tensor, entries: SparseEntries, first: bool, scale: float = 1.0) -> torch.Tensor:
    """The values at the entries once grafted, from ``current`` (a tensor's values there), in its dtype:
    ``(current.float() + delta).to(dtype)``, and theta_ft itself at the exact entries when this is the first adapter
    applied to the tensor (still theta_pre there).

    With ``scale`` a != 1: ``current.float() + a * delta``, and ``theta_pre + a * (theta_ft - theta_pre)`` (fp32) at
    the exact entries. ``a == 1`` takes the unscaled path, so that it stays bit-exact."""
    _, values, (positions, targets) = entries
    if scale == 1.0:
        grafted = current.float() + values
        if first and positions.numel():
            grafted = grafted.index_put((positions.to(grafted.device),), targets.to(grafted.device))
        return grafted.to(current.dtype)
    base = current.float()
    grafted = base + scale * values
    if first and positions.numel():
        positions = positions.to(device=grafted.device, dtype=torch.int64)
        pre = base[positions]
        grafted = grafted.index_put((positions,), pre + scale * (targets.to(grafted.device) - pre))
    return grafted.to(current.dtype)
