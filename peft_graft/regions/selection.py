"""Choosing entries: exact global top-k by a score, and seeded random regions.

Every function returns exactly ``k`` entries with deterministic tie-breaking (by tensor order, then flat index).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch

from .region import Region


def top_k_movement(movement: Mapping[str, torch.Tensor], k: int, within: Region | None = None) -> Region:
    """Exactly ``k`` entries of largest ``|theta_ft - theta_pre|`` over all tensors (the paper's ``gamma_base``).

    ``within``: the result of an earlier call on the same ``movement`` for at least ``k`` entries (e.g. a search
    space). The order is total (the score, then the tensor, then the index), so the top ``k`` are the top ``k`` of
    those: they are chosen there, from the movement at those entries only (``movement.gather(name, indices)`` when the
    mapping has it), instead of passes over every entry. The result is the same either way.
    """
    if within is None or within.num_entries < k:
        return global_top_k(movement, k, key=torch.abs)
    names = [name for name in movement if name in within]
    scores = {name: _entries_at(movement, name, within[name]) for name in names}
    positions = global_top_k(scores, k, key=torch.abs)
    return Region({name: within[name][chosen] for name, chosen in positions.items()})


def _entries_at(tensors: Mapping[str, torch.Tensor], name: str, indices: torch.Tensor) -> torch.Tensor:
    """``tensors[name]`` at the flat ``indices``: through the mapping's ``gather`` when it has one."""
    gather = getattr(tensors, "gather", None)
    if callable(gather):
        return gather(name, indices)
    return tensors[name].detach().reshape(-1)[indices.to(tensors[name].device)]


def global_top_k(
    tensors: Mapping[str, torch.Tensor],
    k: int,
    key: Callable[[torch.Tensor], torch.Tensor] | None = None,
    sample_size: int = 1 << 20,
) -> Region:
    """Exactly ``k`` entries of largest ``key(tensor)`` over all tensors, ties to the earliest tensor and index.

    ``key`` must be element-wise (e.g. ``torch.abs``). Nothing is sorted or concatenated whole: a strided sample of
    ``sample_size`` entries gives a threshold that slightly more than ``k`` entries reach, one pass over the tensors
    (one at a time) collects the entries at or above it, and the exact top-k is taken among them. The result does not
    depend on the sample, which only decides how many entries are collected: if too few, a lower threshold from the
    same sample is tried (another pass), down to every entry. Memory: about 12 bytes per collected entry.

    Tensors are read through :func:`flat_pieces`, so a mapping that computes them (the movement of a checkpoint on
    disk) can hand them over in pieces and never hold a whole one; the sample through :func:`strided_entries`, so such
    a mapping computes only the sampled entries.
    """
    if k < 1:
        raise ValueError(f"The budget k must be at least 1, got {k}.")
    total = sum(numel(tensors, name) for name in tensors)
    if k > total:
        raise ValueError(f"The budget k={k} exceeds the {total} eligible entries.")
    key = key or (lambda t: t)
    sample = _strided_sample(tensors, key, sample_size) if total > 4 * sample_size else None
    expected = -(-k * sample.numel() // total) if sample is not None else 0  # sample entries in the top k
    rank = expected + 4 * math.isqrt(expected) + 32  # 4 sigma above: a second pass is rare
    while True:
        threshold = -torch.inf if sample is None or rank >= sample.numel() else float(torch.topk(sample, rank)[0][-1])
        scores, indices, ends = _entries_at_least(tensors, key, threshold)
        if scores.numel() >= k or threshold == -torch.inf:
            break
        rank *= 4
    if scores.numel() < k:
        raise ValueError(f"Only {scores.numel()} entries have a score that is not NaN; the budget k={k} cannot be met.")
    chosen = _largest_positions(scores, k)  # sorted, so grouped by tensor
    counts = torch.bincount(torch.searchsorted(ends, chosen, right=True), minlength=len(ends)).tolist()
    return Region(dict(zip(tensors, torch.split(indices[chosen], counts), strict=True)))


def _largest_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the ``k`` largest ``scores``, ties to the earliest positions; a selection (``kthvalue``)
    rather than a sort."""
    if k == scores.numel():
        return torch.arange(k)
    kth = torch.kthvalue(scores, scores.numel() - k + 1).values  # the k-th largest
    above = (scores > kth).nonzero().reshape(-1)
    ties = (scores == kth).nonzero().reshape(-1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


def _strided_sample(
    tensors: Mapping[str, torch.Tensor], key: Callable[[torch.Tensor], torch.Tensor], size: int
) -> torch.Tensor:
    """``key`` of about ``size`` entries evenly strided over all tensors. The stride is odd, so it does not alias with
    the power-of-two row lengths of weight matrices."""
    stride = (sum(numel(tensors, name) for name in tensors) // size) | 1
    sample = _Collected(torch.float32)
    for name in tensors:
        sample.add(key(strided_entries(tensors, name, stride).float()))
    return sample.tensor()


def _entries_at_least(
    tensors: Mapping[str, torch.Tensor], key: Callable[[torch.Tensor], torch.Tensor], lower: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, flat indices, ends)`` of every entry scoring at least ``lower``, in tensor order; ``ends[i]`` is the
    number collected from the first ``i + 1`` tensors.

    Works through each tensor in cache-sized chunks: ``key``, the comparison and ``nonzero`` then never write a
    tensor-sized temporary.
    """
    scores, indices, ends = _Collected(), _Collected(torch.int64), []
    for name in tensors:
        for piece_start, piece in flat_pieces(tensors, name):
            for start in range(0, piece.numel(), _CHUNK):
                score = key(piece[start : start + _CHUNK])
                index = (score >= lower).nonzero().reshape(-1)
                scores.add(score[index])
                indices.add(index + piece_start + start)
        ends.append(len(scores))
    return scores.tensor(), indices.tensor(), torch.tensor(ends, dtype=torch.int64)


_CHUNK = 1 << 18


class _Collected:
    """A 1-D CPU tensor grown by appending, with spare capacity that doubles.

    A pass over a large model appends a little after each of thousands of pieces; kept as a list of small tensors,
    those allocations land between the pass's freed temporaries and fragment the C heap, which glibc then keeps (GBs
    of RSS for a 1B model). Here they are a few large buffers. With no ``dtype``, it takes that of the values added,
    promoted (float64 scores stay float64, so near-ties keep their order).
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self._data, self._size, self._follow = torch.empty(1 << 12, dtype=dtype or torch.float32), 0, dtype is None

    def add(self, values: torch.Tensor) -> None:
        if self._follow:
            dtype = values.dtype if self._size == 0 else torch.promote_types(self._data.dtype, values.dtype)
            self._data = self._data.to(dtype)
        end = self._size + values.numel()
        if end > self._data.numel():
            grown = torch.empty(max(end, 2 * self._data.numel()), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown
        self._data[self._size : end] = values.reshape(-1)
        self._size = end

    def __len__(self) -> int:
        return self._size

    def tensor(self) -> torch.Tensor:
        return self._data[: self._size]


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


def strided_entries(tensors: Mapping[str, torch.Tensor], name: str, stride: int) -> torch.Tensor:
    """The entries of ``tensors[name]`` at the flat indices 0 mod ``stride``, in order: through the mapping's
    ``gather(name, indices)`` when it has one (:class:`peft_graft.scores.movement.Movement` then computes only those
    entries), else from :func:`flat_pieces`."""
    if callable(getattr(tensors, "gather", None)):
        return _entries_at(tensors, name, torch.arange(0, numel(tensors, name), stride))
    return torch.cat([piece[-start % stride :: stride] for start, piece in flat_pieces(tensors, name)])


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
