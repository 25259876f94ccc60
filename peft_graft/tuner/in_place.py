"""Unmerged inference without autograd: a graft layer's entries written into the base tensors around the base forward.

A layer builds an :class:`InPlacePlan` once per set of active adapters (finding its entries per tensor and checking
the base, see ``GraftLayer.in_place_plan``) and reuses it while nothing it was built from changes, so serving grafts
costs the base forward plus a few tensor operations per grafted tensor. :meth:`InPlacePlan.is_current` finds each
tensor the plan was built from in the dict of the module holding it (``_parameters``, ``_buffers``: a lookup that
costs a tenth of a module attribute's) and compares object, storage and version; with the adapters' scales and
learning state, that covers every way the plan's inputs change: ``set_region``, loads (in place or by assignment),
device and dtype moves, FSDP's substitutions. A plan holds the (small) entry tensors it watches, so their ids stay
theirs, but only the id and storage address of a base tensor, so a stale plan never keeps a model's weights alive.

The graft model's forward and ``generate`` write every layer's plan once around the whole model
(:func:`written_in_place`); a layer called otherwise writes its own around its base layer (:meth:`InPlacePlan.run`).

While the base tensors hold grafted entries, they are shared state: every graft layer's forward and every model-level
write hold :data:`WRITE_LOCK`, so threads run them one at a time; and a forward nested inside a written one (a hook
or a logits processor calling the model, perhaps with its adapters disabled) first writes theta_pre back
(:func:`suspended_writes`), so it sees exactly the state it asks for.

A model's forward (or generation) holds :data:`WRITE_LOCK` from start to end (:func:`model_forward`), and so does every
change of its state (adapters switched, added, loaded or deleted, merged, unmerged, unloaded, scaled, enabled or
disabled): a thread changing the state waits for the forwards running in other threads, and a forward sees one state
throughout. In its own thread, a hook may change the state only around a nested forward and must switch back before
the outer forward goes on (a forward that ends in another state than it began in is refused, :func:`model_forward`);
structural changes are refused there (:func:`state_change`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .entries import SparseEntries, graft_entries

InPlaceWrite = tuple[dict, str, SparseEntries, float, bool]
"""``(the base layer's parameter dict, tensor attribute, its entries, scale, whether theta_pre still sits there)``:
one adapter's write."""


@dataclass
class InPlacePlan:
    """The writes of one layer's unmerged forward, and what they were built from."""

    writes: list[InPlaceWrite]
    # (dict holding it, key, the entry tensor, its data_ptr, its version)
    watched: list[tuple[dict, str, torch.Tensor, int, int]] = field(default_factory=list)
    bases: list[tuple[dict, str, int, int]] = field(default_factory=list)  # (dict, key, id, data_ptr): base tensors
    absent: list[tuple[dict, str]] = field(default_factory=list)  # entry tensors an adapter does not have
    scales: list[tuple[dict, str, float]] = field(default_factory=list)  # (layer.scaling, adapter, scale)
    learning: list[tuple[dict, str]] = field(default_factory=list)  # (graft_learning's modules, adapter)
    slots: list[tuple[dict, str, Any]] = field(default_factory=list)  # (layer.packed, adapter, its store or None)
    # The values of a mixed batch's "sparse_delta" mode built from this one-adapter plan (sparse_delta.py), kept with
    # it: (what the mode does with the layer, the graft's values there or None where the exact path is needed);
    # None: not built.
    sparse_delta: tuple[tuple, Any] | None = None

    def watch(self, owner: dict, key: str) -> None:
        """Record the entry tensor ``owner[key]`` (possibly absent) as an input of the plan."""
        tensor = owner.get(key)
        if tensor is None:
            self.absent.append((owner, key))
        else:
            self.watched.append((owner, key, tensor, tensor.data_ptr(), tensor._version))

    def watch_slot(self, owner: dict, key: str) -> None:
        """Record ``owner.get(key)`` (a packed adapter's store, or ``None``) as an input of the plan."""
        self.slots.append((owner, key, owner.get(key)))

    def watch_base(self, owner: dict, key: str) -> None:
        """Record the base tensor ``owner[key]`` as an input of the plan (its values are read at every write)."""
        tensor = owner[key]
        self.bases.append((owner, key, id(tensor), tensor.data_ptr()))

    def is_current(self) -> bool:
        """Whether the plan still holds: no input was replaced or written, no scale or learning state changed."""
        for owner, key, tensor, data_ptr, version in self.watched:
            if owner.get(key) is not tensor or tensor._version != version or tensor.data_ptr() != data_ptr:
                return False
        for owner, key, identity, data_ptr in self.bases:
            tensor = owner.get(key)
            if id(tensor) != identity or tensor.data_ptr() != data_ptr:
                return False
        # Loops rather than all() over generators (slots is mostly empty): a mixed batch checks every plan per layer
        for missing in (self.absent, self.learning):
            for owner, key in missing:
                if key in owner:
                    return False
        for owner, key, scale in self.scales:
            if owner.get(key, 1.0) != scale:
                return False
        return all(owner.get(key) is slot for owner, key, slot in self.slots)

    def run(self, base_layer: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The base forward (``base_layer``, or a call computing it) with the entries written into the base tensors,
        which get their originals back after it (also on an error)."""
        saved: list[Saved] = []
        try:
            self.write(saved)
            return base_layer(*args, **kwargs)
        finally:
            restore(saved)

    def write(self, saved: list[Saved], written: set[int] | None = None) -> None:
        """Write the grafted entries into the base tensors, appending the originals to ``saved`` as it goes (so
        :func:`restore` undoes exactly what was written, even after an error); a tensor whose id is in ``written``
        already holds them (a tied tensor written by another layer's plan) and is left alone. Adds the ids of the
        tensors it writes to ``written``.

        Writes go through ``.data``, so the parameters' version counters (autograd's) do not move; the originals are
        read at every call, so the result follows whatever the base tensors hold. ``take`` and ``put_`` index a tensor
        as flat."""
        mine = []
        for parameters, attr, entries, scale, first in self.writes:
            parameter = parameters[attr]
            if written is not None and id(parameter) in written:
                continue
            data, indices = parameter.data, entries[0]
            original = data.take(indices)
            saved.append((data, indices, original))
            data.put_(indices, graft_entries(original, entries, first, scale))
            mine.append(id(parameter))
        if written is not None:
            written.update(mine)


Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(a base tensor's data, flat indices, its values there before a write)``."""


def restore(saved: list[Saved]) -> None:
    """Write the originals back, last write first."""
    for data, indices, original in reversed(saved):
        data.put_(indices, original)


WRITE_LOCK = threading.RLock()
"""Held by every graft layer's forward, every model's forward and generation, around every model-level write and
every change of a model's state (re-entrant: a nested forward in the same thread takes it again)."""


class _Forwards:
    """The graft forwards under way. Only a thread holding :data:`WRITE_LOCK` runs one, and it holds the lock until
    its forward ends: a thread that holds the lock and finds ``depth > 0`` is inside a forward itself."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0  # forwards of graft models and graft layers under way, changed only under WRITE_LOCK


FORWARDS = _Forwards()


@contextmanager
def model_forward(model: Any) -> Iterator[None]:
    """Hold :data:`WRITE_LOCK` for a whole forward (or generation) of ``model`` (a graft model, with a
    ``forward_state()`` method), and refuse its output when its state changed in between (a hook switched adapters or
    the scale and did not switch back): the forward would have run partly in one state and partly in another."""
    with WRITE_LOCK:
        state = model.forward_state()
        FORWARDS.depth += 1
        try:
            yield
        finally:
            FORWARDS.depth -= 1
        current = model.forward_state()
        if current is not state and current != state:
            raise ValueError(
                "The graft model's state (active adapters, scale, adapters enabled or disabled) changed during its "
                "forward, from a hook or a logits processor: the forward ran partly in one state and partly in "
                "another, mixing two adapters. A hook may change the state only around a nested forward and must "
                "restore it before returning (`with model.disable_adapter(): ...`, or set_adapter back in a finally)."
            )


@contextmanager
def state_change(what: str, structural: bool = True) -> Iterator[None]:
    """Hold :data:`WRITE_LOCK` for a change of a model's state, so that no forward of another thread sees part of it.
    A ``structural`` change (merging, adding, loading, deleting, unloading: one that reads or rewrites the base
    tensors or the adapters' tensors) is refused inside a forward of this thread (from a hook), where the base tensors
    hold grafted entries; switching adapters, the scale or enabling is allowed there around a nested forward."""
    with WRITE_LOCK:
        if structural and FORWARDS.depth:
            raise ValueError(
                f"{what} cannot run inside a forward of a graft model (from a forward hook, a logits processor or a "
                "nested call): the base tensors hold the grafted entries then, and the forward would mix two states. "
                "Call it before or after the forward."
            )
        yield


@dataclass
class ModelWrite:
    """The plans of a whole model's graft layers, written once (:func:`written_in_place`), and the originals to write
    back."""

    layers: list
    plans: list[InPlacePlan]
    saved: list[Saved] = field(default_factory=list)

    def write(self) -> None:
        """Write every plan (a tied tensor once) and mark the layers as written (``written_plan``)."""
        written: set[int] = set()
        for layer, plan in zip(self.layers, self.plans, strict=True):
            plan.write(self.saved, written)
            layer.written_plan = plan

    def undo(self) -> None:
        """Write the originals back and unmark the layers."""
        for layer in self.layers:
            layer.written_plan = None
        restore(self.saved)
        self.saved.clear()


_IN_EFFECT: list[ModelWrite] = []
"""The model-level writes in effect, outermost first (only the thread holding :data:`WRITE_LOCK` has any)."""


@contextmanager
def suspended_writes() -> Iterator[None]:
    """Within this context every model-level write in effect is undone (the base tensors hold what they hold outside
    a forward); they are written again at exit. For a forward nested inside a written one, which may ask for another
    state (adapters disabled or switched, another scale, autograd on)."""
    with WRITE_LOCK:
        active = list(_IN_EFFECT)
        for model_write in reversed(active):
            model_write.undo()
        _IN_EFFECT.clear()  # undone: a suspension nested in this one has nothing to undo, nor to write again
        try:
            yield
        finally:
            _IN_EFFECT.extend(active)
            for model_write in active:
                model_write.write()


@contextmanager
def written_in_place(layers: list) -> Iterator[None]:
    """Within this context, for a forward without autograd, the entries of every graft layer in ``layers`` (a whole
    model's) sit in the base tensors, and the layers call their base layers directly (``written_plan``); the
    originals are written back at exit, also on an error.

    The same writes as each layer's own :meth:`InPlacePlan.run`, done once per model forward (or ``generate``) rather
    than around each layer's forward: the Python work of a layer's forward then runs in one tight loop. A tensor tied
    between layers is written once. Where any layer's in-place forward does not apply (autograd on, a soft region,
    adapters disabled or merged, FSDP2), nothing is written here and each layer runs its own forward. Nested inside
    another model-level write (same thread), that one is suspended for the duration (:func:`suspended_writes`)."""
    with WRITE_LOCK, suspended_writes() if _IN_EFFECT else nullcontext():
        plans = [] if torch.is_grad_enabled() else [layer.in_place_plan() for layer in layers]  # checks first
        if not plans or any(plan is None for plan in plans):
            yield
            return
        model_write = ModelWrite(layers, plans)
        _IN_EFFECT.append(model_write)
        try:
            model_write.write()
            yield
        finally:
            model_write.undo()
            _IN_EFFECT.pop()


def tensor_dict(container: nn.Module) -> dict[str, Any]:
    """The dict a ``ParameterDict`` or ``BufferDict`` keeps its tensors in, by key."""
    return container._parameters if isinstance(container, nn.ParameterDict) else container._buffers
