"""Regions: sets of parameter entries, how to choose them, and their algebra.

A :class:`Region` maps a parameter name to the sorted flat indices of its grafted entries. Every strategy returns
exactly ``k`` entries with deterministic tie-breaking (by tensor order, then flat index).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class Region(Mapping[str, torch.Tensor]):
    """An immutable set of entries: parameter name -> sorted unique flat indices (int64)."""

    def __init__(self, indices: Mapping[str, torch.Tensor] | None = None):
        self._indices: dict[str, torch.Tensor] = {}
        for name, idx in (indices or {}).items():
            idx = torch.as_tensor(idx).reshape(-1)
            if idx.is_floating_point() or idx.dtype == torch.bool:
                raise TypeError(f"Region indices of {name!r} must be integers, got {idx.dtype}.")
            idx = torch.unique(idx.to(torch.int64).cpu())
            if idx.numel() and idx[0] < 0:
                raise ValueError(f"Region indices of {name!r} must be non-negative, got {idx[0].item()}.")
            if idx.numel():
                self._indices[name] = idx

    @classmethod
    def from_masks(cls, masks: Mapping[str, torch.Tensor]) -> Region:
        """Region of the ``True`` entries of boolean masks keyed by parameter name."""
        for name, mask in masks.items():
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"Mask {name!r} must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}.")
        return cls({name: mask.reshape(-1).nonzero().reshape(-1) for name, mask in masks.items()})

    def to_masks(self, shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
        """Dense boolean masks of the given shapes (one per name in ``shapes``)."""
        masks = {}
        for name, shape in shapes.items():
            mask = torch.zeros(shape, dtype=torch.bool)
            if name in self._indices:
                mask.view(-1)[self._indices[name]] = True
            masks[name] = mask
        return masks

    # Mapping protocol
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._indices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)

    @property
    def num_entries(self) -> int:
        """Number of entries in the region."""
        return sum(int(idx.numel()) for idx in self._indices.values())

    def __repr__(self) -> str:
        return f"Region({self.num_entries} entries in {len(self._indices)} tensors)"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Region):
            return NotImplemented
        return self._indices.keys() == other._indices.keys() and all(
            torch.equal(idx, other._indices[n]) for n, idx in self._indices.items()
        )

    __hash__ = None

    # Algebra
    def __or__(self, other: Region) -> Region:
        names = self._indices.keys() | other._indices.keys()
        empty = torch.empty(0, dtype=torch.int64)
        return Region({n: torch.cat([self._indices.get(n, empty), other._indices.get(n, empty)]) for n in names})

    def __and__(self, other: Region) -> Region:
        return Region(
            {n: idx[torch.isin(idx, other._indices[n])] for n, idx in self._indices.items() if n in other._indices}
        )

    def __sub__(self, other: Region) -> Region:
        return Region(
            {n: idx[~torch.isin(idx, other._indices[n])] if n in other else idx for n, idx in self._indices.items()}
        )

    union, intersection, difference = __or__, __and__, __sub__

    def overlap(self, other: Region) -> float:
        """The paper's asymmetric overlap ``|self & other| / |other|`` (Figure 8a)."""
        return (self & other).num_entries / other.num_entries if other.num_entries else 0.0

    def iou(self, other: Region) -> float:
        """Intersection over union ``|self & other| / |self | other|``."""
        union = (self | other).num_entries
        return (self & other).num_entries / union if union else 0.0


def top_k_movement(movement: Mapping[str, torch.Tensor], k: int) -> Region:
    """Exactly ``k`` entries of largest ``|theta_ft - theta_pre|`` over all tensors (the paper's ``gamma_base``)."""
    return global_top_k(movement, k, key=torch.abs)


def global_top_k(
    tensors: Mapping[str, torch.Tensor], k: int, key: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> Region:
    """Exactly ``k`` entries of largest ``key(tensor)`` over all tensors, ties to the earliest tensor and index.

    Never sorts or concatenates everything, and ``key`` is applied one tensor at a time: each tensor offers its own
    top-k candidates, and the k-th largest candidate is the global threshold.
    """
    if k < 1:
        raise ValueError(f"The budget k must be at least 1, got {k}.")
    total = sum(t.numel() for t in tensors.values())
    if k > total:
        raise ValueError(f"The budget k={k} exceeds the {total} eligible entries.")
    key = key or (lambda t: t)
    candidates = [torch.topk(key(t).reshape(-1), min(k, t.numel()), sorted=False).values for t in tensors.values()]
    threshold = torch.topk(torch.cat(candidates), k, sorted=False).values.min()
    del candidates
    chosen, ties, remaining = {}, {}, k
    for name, tensor in tensors.items():
        score = key(tensor).reshape(-1)
        chosen[name] = (score > threshold).nonzero().reshape(-1)
        ties[name] = (score == threshold).nonzero().reshape(-1)
        remaining -= chosen[name].numel()
    for name, tied in ties.items():
        take = tied[:remaining]
        remaining -= take.numel()
        chosen[name] = torch.cat([chosen[name], take])
    return Region(chosen)


def random_region(sizes: Mapping[str, int], k: int, seed: int) -> Region:
    """Exactly ``k`` distinct entries drawn uniformly (seeded) from tensors of the given sizes."""
    total = sum(sizes.values())
    if not 1 <= k <= total:
        raise ValueError(f"The budget k={k} must lie in [1, {total}] (the number of eligible entries).")
    generator = torch.Generator().manual_seed(seed)
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < k:  # rejection sampling: O(k) memory, never a permutation of everything
        draw = torch.randint(total, (2 * (k - picked.numel()) + 16,), generator=generator)
        merged = torch.cat([picked, draw])
        _, first = _first_occurrences(merged)
        picked = merged[first][:k]
    picked, _ = torch.sort(picked)
    names = list(sizes)
    offsets = torch.tensor([0, *torch.tensor(list(sizes.values())).cumsum(0).tolist()])
    owner = torch.searchsorted(offsets, picked, right=True) - 1
    return Region({names[i]: picked[owner == i] - offsets[i] for i in owner.unique().tolist()})


def _first_occurrences(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique values and the positions of their first occurrence, in order of first occurrence."""
    unique, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((unique.numel(),), values.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel()), reduce="amin")
    return unique, torch.sort(first).values
