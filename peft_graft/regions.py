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
    tensors: Mapping[str, torch.Tensor],
    k: int,
    key: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sample_size: int = 1 << 20,
) -> Region:
    """Exactly ``k`` entries of largest ``key(tensor)`` over all tensors, ties to the earliest tensor and index.

    ``key`` must be element-wise (e.g. ``torch.abs``). Nothing is sorted or concatenated whole: a seeded sample of
    ``sample_size`` entries gives a lower bound that a few times ``k`` entries reach, one pass over the tensors (one
    at a time) collects those candidates, and the exact top-k is taken among them. The result does not depend on the
    sample, which only decides how many candidates there are (if too few, every entry becomes a candidate).
    """
    if k < 1:
        raise ValueError(f"The budget k must be at least 1, got {k}.")
    total = sum(t.numel() for t in tensors.values())
    if k > total:
        raise ValueError(f"The budget k={k} exceeds the {total} eligible entries.")
    key = key or (lambda t: t)
    lower = _candidate_bound(tensors, k, key, sample_size)
    candidates = _candidates(tensors, key, lower)
    if candidates[0].numel() < k and lower > -torch.inf:
        candidates = _candidates(tensors, key, -torch.inf)
    scores, owners, indices = candidates
    if scores.numel() < k:
        raise ValueError(f"Only {scores.numel()} entries have a finite score; the budget k={k} cannot be met.")
    chosen = torch.sort(scores, descending=True, stable=True).indices[:k]  # candidates are in tie-break order
    owners, indices = owners[chosen], indices[chosen]
    names = list(tensors)
    return Region({names[i]: indices[owners == i] for i in owners.unique().tolist()})


def _candidate_bound(
    tensors: Mapping[str, torch.Tensor], k: int, key: Callable[[torch.Tensor], torch.Tensor], sample_size: int
) -> float:
    """A score that about ``3 k`` entries reach, estimated from an evenly strided sample (``-inf`` for small inputs).

    The stride is odd, so it does not alias with the power-of-two row lengths of weight matrices.
    """
    total = sum(t.numel() for t in tensors.values())
    if total <= 4 * sample_size:
        return -torch.inf
    stride = (total // sample_size) | 1
    sample = torch.cat([key(t.detach().reshape(-1)[::stride].float()).cpu() for t in tensors.values()])
    rank = min(sample.numel(), 3 * -(-k * sample.numel() // total) + 32)  # 3x the expected sample hits, plus slack
    return float(torch.topk(sample, rank).values[-1])


def _candidates(
    tensors: Mapping[str, torch.Tensor], key: Callable[[torch.Tensor], torch.Tensor], lower: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, tensor positions, flat indices)`` of every entry scoring at least ``lower``, in tensor order.

    Works through each tensor in cache-sized chunks: ``key``, the comparison and ``nonzero`` then never write a
    tensor-sized temporary.
    """
    scores, owners, indices = [], [], []
    for i, tensor in enumerate(tensors.values()):
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            score = key(flat[start : start + _CHUNK])
            index = (score >= lower).nonzero().reshape(-1)
            scores.append(score[index].float())
            indices.append(index + start)
            owners.append(torch.full_like(index, i))
    return torch.cat(scores).cpu(), torch.cat(owners).cpu(), torch.cat(indices).cpu()


_CHUNK = 1 << 18


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
