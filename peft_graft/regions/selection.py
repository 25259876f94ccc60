"""Choosing entries: exact global top-k by a score, and seeded random regions.

Every function returns exactly ``k`` entries with deterministic tie-breaking (by tensor order, then flat index).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from .region import Region


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

    ``key`` must be element-wise (e.g. ``torch.abs``). Nothing is sorted or concatenated whole: a strided sample of
    ``sample_size`` entries gives a threshold that a few times ``k`` entries reach, one pass over the tensors (one
    at a time) collects the entries at or above it, and the exact top-k is taken among them. The result does not
    depend on the sample, which only decides how many entries are collected (if too few, every entry is).

    Tensors are read through :func:`flat_pieces`, so a mapping that computes them (the movement of a checkpoint on
    disk) can hand them over in pieces and never hold a whole one.
    """
    if k < 1:
        raise ValueError(f"The budget k must be at least 1, got {k}.")
    total = sum(numel(tensors, name) for name in tensors)
    if k > total:
        raise ValueError(f"The budget k={k} exceeds the {total} eligible entries.")
    key = key or (lambda t: t)
    threshold = _sampled_threshold(tensors, k, key, sample_size)
    collected = _entries_at_least(tensors, key, threshold)
    if collected[0].numel() < k and threshold > -torch.inf:
        collected = _entries_at_least(tensors, key, -torch.inf)
    scores, owners, indices = collected
    if scores.numel() < k:
        raise ValueError(f"Only {scores.numel()} entries have a finite score; the budget k={k} cannot be met.")
    chosen = torch.sort(scores, descending=True, stable=True).indices[:k]  # collected in tie-break order
    owners, indices = owners[chosen], indices[chosen]
    names = list(tensors)
    return Region({names[i]: indices[owners == i] for i in owners.unique().tolist()})


def _sampled_threshold(
    tensors: Mapping[str, torch.Tensor], k: int, key: Callable[[torch.Tensor], torch.Tensor], sample_size: int
) -> float:
    """A score that about ``3 k`` entries reach, estimated from an evenly strided sample (``-inf`` for small inputs).

    The stride is odd, so it does not alias with the power-of-two row lengths of weight matrices.
    """
    total = sum(numel(tensors, name) for name in tensors)
    if total <= 4 * sample_size:
        return -torch.inf
    stride = (total // sample_size) | 1
    sample = torch.cat(
        [
            key(piece[-start % stride :: stride].float()).cpu()  # the entries of the tensor's flat index 0 mod stride
            for name in tensors
            for start, piece in flat_pieces(tensors, name)
        ]
    )
    rank = min(sample.numel(), 3 * -(-k * sample.numel() // total) + 32)  # 3x the expected sample hits, plus slack
    return float(torch.topk(sample, rank).values[-1])


def _entries_at_least(
    tensors: Mapping[str, torch.Tensor], key: Callable[[torch.Tensor], torch.Tensor], lower: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, tensor positions, flat indices)`` of every entry scoring at least ``lower``, in tensor order.

    Works through each tensor in cache-sized chunks: ``key``, the comparison and ``nonzero`` then never write a
    tensor-sized temporary.
    """
    scores, owners, indices = [], [], []
    for i, name in enumerate(tensors):
        for piece_start, piece in flat_pieces(tensors, name):
            for start in range(0, piece.numel(), _CHUNK):
                score = key(piece[start : start + _CHUNK])
                index = (score >= lower).nonzero().reshape(-1)
                scores.append(score[index].float())
                indices.append(index + piece_start + start)
                owners.append(torch.full_like(index, i))
    return torch.cat(scores).cpu(), torch.cat(owners).cpu(), torch.cat(indices).cpu()


_CHUNK = 1 << 18


def numel(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    """Number of entries of ``tensors[name]``, from the mapping's ``numel(name)`` when it has one (without computing
    the tensor)."""
    size = getattr(tensors, "numel", None)
    return size(name) if callable(size) else tensors[name].numel()


def flat_pieces(tensors: Mapping[str, torch.Tensor], name: str) -> Iterator[tuple[int, torch.Tensor]]:
    """``(flat start, piece)`` covering ``tensors[name].reshape(-1)`` in order: the mapping's ``pieces(name)`` when it
    has one (e.g. :class:`peft_graft.scores.movement.Movement`, which computes one piece at a time), else views of
    the tensor."""
    pieces = getattr(tensors, "pieces", None)
    if callable(pieces):
        yield from pieces(name)
        return
    flat = tensors[name].detach().reshape(-1)
    yield 0, flat


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
