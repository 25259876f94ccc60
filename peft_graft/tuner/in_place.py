"""Unmerged inference without autograd: a graft layer's entries written into the base tensors around the base forward.

A layer builds an :class:`InPlacePlan` once (finding its entries per tensor and checking the base, see
``GraftLayer._forward_in_place``) and reuses it while nothing it was built from changes, so serving a graft costs the
base forward plus a few tensor operations per grafted tensor. :meth:`InPlacePlan.is_current` finds each tensor the
plan was built from in the dict of the module holding it (``_parameters``, ``_buffers``: a lookup that costs a tenth
of a module attribute's) and compares object, storage and version; with the active adapters, their scales and
learning state, that covers every way the plan's inputs change: ``set_region``, loads (in place or by assignment),
device and dtype moves, FSDP's substitutions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .entries import SparseEntries, graft_entries

InPlaceWrite = tuple[str, SparseEntries, float, bool]
"""``(tensor attribute, its entries, scale, whether theta_pre still sits there)``: one adapter's write."""


@dataclass
class InPlacePlan:
    """The writes of one layer's unmerged forward, and what they were built from."""

    writes: list[InPlaceWrite]
    adapters: tuple[str, ...]
    # (dict holding it, key, the object or None, its (data_ptr, version)): base tensors and entry tensors
    watched: list[tuple[dict, str, torch.Tensor | None, tuple[int, int]]] = field(default_factory=list)
    scales: list[tuple[dict, str, float]] = field(default_factory=list)  # (layer.scaling, adapter, scale)
    learning: list[tuple[dict, str]] = field(default_factory=list)  # (graft_learning's modules, adapter)

    def watch(self, owner: dict, key: str) -> None:
        """Record ``owner[key]`` (possibly absent) as an input of the plan."""
        tensor = owner.get(key)
        self.watched.append(
            (owner, key, tensor, *((tensor.data_ptr(), tensor._version) if tensor is not None else (0, 0)))
        )

    def is_current(self, adapters: tuple[str, ...]) -> bool:
        """Whether the plan still holds for ``adapters`` (the active ones): no input was replaced or written."""
        if adapters != self.adapters:
            return False
        for owner, key, tensor, data_ptr, version in self.watched:
            now = owner.get(key)
            if now is not tensor or (
                tensor is not None and (tensor._version, tensor.data_ptr()) != (version, data_ptr)
            ):
                return False
        return all(owner.get(key, 1.0) == scale for owner, key, scale in self.scales) and not any(
            key in owner for owner, key in self.learning
        )

    def run(self, base_layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The base forward with the entries written into the base tensors, which get their originals back after it
        (also on an error).

        Writes go through ``.data``, so the parameters' version counters (autograd's) do not move; the originals are
        read at every call, so the result follows whatever the base tensors hold."""
        saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        try:
            for attr, entries, scale, first in self.writes:
                flat, indices = getattr(base_layer, attr).data.view(-1), entries[0]
                original = flat.take(indices)
                saved.append((flat, indices, original))
                flat.put_(indices, graft_entries(original, entries, first, scale))
            return base_layer(*args, **kwargs)
        finally:
            for flat, indices, original in reversed(saved):
                flat.put_(indices, original)


def _state(tensor: torch.Tensor | None) -> tuple[int, int]:
    """Where a tensor's data is and how often it was written in place (``(0, 0)`` for an absent one)."""
    return (0, 0) if tensor is None else (tensor.data_ptr(), tensor._version)


def tensor_dict(container: nn.Module) -> dict[str, Any]:
    """The dict a ``ParameterDict`` or ``BufferDict`` keeps its tensors in, by key."""
    return container._parameters if isinstance(container, nn.ParameterDict) else container._buffers
