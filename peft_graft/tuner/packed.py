"""Frozen grafts held in one flat store per adapter, so that many loaded grafts cost about their bytes (issue 28).

A graft layer holds each adapter's entries as up to four small tensors (indices, fp32 values, exact positions and
values). A tensor costs about 0.6 KB beyond its data, so a graft of 0.01% of a RoBERTa-base (about 12k entries over
about 100 layers) costs more in tensor objects than in entries. :func:`pack_adapter` concatenates a frozen adapter's
tensors of every layer into one :class:`PackedStore` (four flat tensors, and a table of offsets); each layer then keeps
only the store in ``GraftLayer.packed`` (its row, the same in every store, is ``GraftLayer.pack_row``) and reads its
entries as views of the store when it needs them (the layer caches its per-tensor split, as for unpacked adapters).
Nothing else changes: outputs, merges and saved files are bit for bit those of the unpacked adapter. A layer unpacks
(gets its own tensors back, :meth:`GraftLayer.unpack`) before anything could train the adapter or change its tensors:
``set_adapter`` without ``inference_mode``, ``set_requires_grad``, ``set_region``, loading its keys, and ``.to()`` to
another device or dtype.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from array import array
from collections.abc import Callable, Iterable

import torch
from torch import nn

RELEASE_FREE_HEAP = True
"""Hand the C heap's free pages back to the system after a graft is packed or a packed graft deleted
(:func:`release_free_heap`); a switch for tests and benchmarks."""

STORE_KEYS = ("indices", "values", "positions", "targets")
"""The flat tensors of a store: indices (the layers' index dtype), fp32 values, exact positions, exact theta_ft."""


class PackedStore:
    """One adapter's entries on several layers: ``tensors`` (see :data:`STORE_KEYS`) and, per layer row, the
    ``[start, stop)`` of its entries in ``indices``/``values`` and of its exact entries in ``positions``/``targets``
    (empty for a layer without the adapter), and what the layer records of theta_pre (``GraftLayer.fingerprints``,
    ``checksums``, ``verify_base``), kept here rather than in three dicts per layer."""

    __slots__ = ("__weakref__", "checksums", "fingerprints", "offsets", "tensors", "verify_base")

    def __init__(self, tensors: dict[str, torch.Tensor], offsets: array, rows: int) -> None:
        self.tensors = tensors
        self.offsets = offsets  # 4 ints per row: entries start, stop, exact start, exact stop
        self.fingerprints: list[list[float] | None] = [None] * rows
        self.checksums: list[str | None] = [None] * rows
        self.verify_base = bytearray(b"\x02" * rows)  # per row: 0 False, 1 True, 2 absent

    def entries(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of layer ``row``, as views of the store."""
        start, stop = self.offsets[4 * row], self.offsets[4 * row + 1]
        return self.tensors["indices"][start:stop], self.tensors["values"][start:stop]

    def exact_entries(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions, theta_ft)`` of layer ``row``'s exact entries as views, or ``None`` when it has none."""
        start, stop = self.offsets[4 * row + 2], self.offsets[4 * row + 3]
        if start == stop:
            return None
        return self.tensors["positions"][start:stop], self.tensors["targets"][start:stop]

    def nbytes(self) -> int:
        """Bytes of the store's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def can_pack(layer: nn.Module, adapter_name: str) -> bool:
    """Whether ``layer`` (a ``GraftLayer``: typed as a module, layer.py imports this one) holds a frozen hard region of
    ``adapter_name`` in its own tensors, with its entries loaded."""
    if adapter_name not in layer.graft_values or layer.is_learning(adapter_name):
        return False
    if layer.graft_values[adapter_name].requires_grad:
        return False
    if adapter_name in layer.awaiting_entries:
        indices = layer.graft_indices[adapter_name]
        if indices.numel() and int(indices.min()) < 0:  # never loaded: check_filled refuses it at first use
            return False
    return True


def pack_adapter(layers: Iterable[nn.Module], adapter_name: str) -> list[PackedStore]:
    """Move the frozen hard region of ``adapter_name`` on ``layers`` into flat stores (one per index dtype and device),
    each layer reading its row (``pack_row``, given to the layers without one, after the others: ``layers`` are all the
    model's graft layers). Layers where it is not frozen and hard (:func:`can_pack`) are left as they are. Everything
    is concatenated before any layer changes. Returns the stores made."""
    layers = list(layers)
    next_row = max((layer.pack_row for layer in layers if layer.pack_row is not None), default=-1) + 1
    groups: dict[tuple, list[nn.Module]] = {}
    for layer in layers:
        if can_pack(layer, adapter_name):
            indices = layer.graft_indices[adapter_name]
            groups.setdefault((indices.dtype, indices.device), []).append(layer)
    for members in groups.values():
        for layer in members:
            if layer.pack_row is None:
                layer.pack_row, next_row = next_row, next_row + 1
    made = []
    for (index_dtype, device), members in groups.items():
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in STORE_KEYS}
        rows = max(layer.pack_row for layer in members) + 1
        bounds = [0] * (4 * rows)
        count = exact = 0
        for layer in members:
            indices, values = layer.graft_indices[adapter_name], layer.graft_values[adapter_name].detach()
            parts["indices"].append(indices)
            parts["values"].append(values.to(device))
            num_exact = 0
            if adapter_name in layer.graft_exact_positions:
                positions = layer.graft_exact_positions[adapter_name]
                parts["positions"].append(positions.to(device, index_dtype))
                parts["targets"].append(layer.graft_exact_values[adapter_name].to(device))
                num_exact = positions.numel()
            row = layer.pack_row
            bounds[4 * row : 4 * row + 4] = count, count + indices.numel(), exact, exact + num_exact
            count, exact = count + indices.numel(), exact + num_exact
        dtypes = {"indices": index_dtype, "values": torch.float32, "positions": index_dtype, "targets": torch.float32}
        with torch.inference_mode(False):  # tensors with version counters (the caches stamp them)
            tensors = {
                key: torch.cat(parts[key]) if parts[key] else torch.empty(0, dtype=dtypes[key], device=device)
                for key in STORE_KEYS
            }
        store = PackedStore(tensors, array("i" if count < 2**31 else "q", bounds), rows)
        for layer in members:  # the layer's records of theta_pre move to the store with its entries
            store.fingerprints[layer.pack_row] = layer.fingerprints.get(adapter_name)
            store.checksums[layer.pack_row] = layer.checksums.get(adapter_name)
            store.verify_base[layer.pack_row] = int(layer.verify_base.get(adapter_name, 2))
            layer.attach_packed(adapter_name, store)
        made.append(store)
    return made


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` on another C library."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Return the free pages of the C heap to the system (glibc's ``malloc_trim(0)``; nothing elsewhere).

    Loading a graft allocates and frees several times its bytes (the file, its checks, the layers' tensors before
    packing); glibc keeps freed pages in the middle of the heap resident, so without this the RSS of a thousand loaded
    grafts is about twice what they hold, and deleting them gives little back. Costs a walk of the heap (a few ms)."""
    trim = _malloc_trim() if RELEASE_FREE_HEAP else None
    if trim is not None:
        trim(0)
