"""Mixed-graft batches: ``peft_model(**inputs, adapter_names=[...])``, one graft per example, as peft's LoRA offers.

Two modes (``model.set_mixed_batch_mode``). The default, ``"sparse_delta"``, runs a linear layer whose grafts are sparse
enough there, an ``nn.LayerNorm``, and a layer whose grafted tensors are vectors (an RMSNorm's weight) once for the
whole batch, plus each example's graft (sparse_delta.py: linear layers and LayerNorms within stated rounding bounds,
vector layers bit-exact where checked); other layers, and every layer while autograd is on, take the exact path. It is
the default because it is level with peft LoRA's mixed batches where the exact mode is not (docs/serving.md).

The exact path, all of ``"exact"``: each graft layer splits the batch by the graft its examples ask for and runs its
base layer once per group, with that graft's entries written into the base tensors for the group's call (the same
:class:`InPlacePlan` as a single-graft forward, written and restored around each call); examples whose graft has no
entries in the layer (and those asking for ``"__base__"``, the pre-trained model) share one call on the base tensors as
they are. Each example therefore goes through exactly the arithmetic of a forward with only its graft active, on its
group's rows; on the CPU a row of a matrix product does not depend on the other rows of its batch, so outputs are
bit-exact (``tests/test_mixed_batch.py``). A head stored whole (``modules_to_save``, e.g. a classification head per
task) runs this way in both modes: each group through its graft's copy.

The state lives on the layers (``GraftLayer.mixed_batch``) and on the tuner for the duration of the forward or
``generate`` and is set and cleared under :data:`~peft_graft.tuner.in_place.WRITE_LOCK`, so a mixed batch keeps the
single-graft path's guarantees: threads run one at a time, a forward nested inside it (a hook calling the model without
``adapter_names``) runs in the model's ordinary state, and the base tensors get their values back bit for bit, also
after an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

from . import sparse_delta
from .in_place import _IN_EFFECT, WRITE_LOCK, suspended_writes
from .sparse_delta import ExampleParameters, LayerDelta, LayerNormColumns, Scratch, to_device

_ALIGNMENT = 64  # bytes: PyTorch's CPU allocator aligns every tensor so, and MKL's results may depend on it

MIXED_BATCH_MODES = ("exact", "sparse_delta")
"""``"exact"``: per-group base calls, bit-exact per example; ``"sparse_delta"`` (the default): see the module doc."""

DEFAULT_MIXED_BATCH_MODE = "sparse_delta"
"""The mode of a model that never called ``set_mixed_batch_mode``: level with peft LoRA's mixed batches, where the
exact mode runs every graft layer once per graft (docs/serving.md, "Which mode")."""

SCRATCH = "_mixed_batch_scratch"
"""The attribute of a graft model holding its layers' shared intermediate results (``sparse_delta.Scratch``) per
device."""

BASE = "__base__"
"""The name that asks for the pre-trained model in ``adapter_names``, as in peft."""

Group = tuple[str, slice | torch.Tensor]
"""``(graft name or "__base__", its examples: a slice when contiguous)``."""


@dataclass
class MixedBatch:
    """One graft name per example, and the groups of examples per name (found once, shared by every layer)."""

    names: list[str]
    sparse_delta: bool = False  # the "sparse_delta" mode (see the module doc)
    positions: dict[str, list[int]] = field(default_factory=dict)
    holders: dict[int, frozenset[str]] = field(default_factory=dict)  # by id(layer): the grafts with entries there
    # by id(layer), in the "sparse_delta" mode: what the layer runs with (None: the exact path)
    deltas: dict[int, LayerDelta | LayerNormColumns | ExampleParameters | None] = field(default_factory=dict)
    # in the "sparse_delta" mode, the layers whose deltas are not built yet: all at once, at the first layer call that
    # uses one (none does while autograd is on, so nothing is built then)
    unprepared: list[nn.Module] = field(default_factory=list)
    # the model's intermediate results per device (sparse_delta.Scratch), shared by its layers; None in a batch nested
    # inside another (from a hook), which leaves the layers' kept buffers alone
    scratch: dict[torch.device, Scratch] | None = None
    _groups: dict[torch.device, list[Group]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for position, name in enumerate(self.names):
            self.positions.setdefault(name, []).append(position)

    def groups(self, device: torch.device) -> list[Group]:
        """One group per name, in order of first appearance: ``(name, its examples)``."""
        if device not in self._groups:
            self._groups[device] = [(name, _index(positions, device)) for name, positions in self.positions.items()]
        return self._groups[device]


def _index(positions: list[int], device: torch.device) -> slice | torch.Tensor:
    if positions == list(range(positions[0], positions[-1] + 1)):
        return slice(positions[0], positions[-1] + 1)
    return to_device(torch.tensor(positions, dtype=torch.int64), device)


def check_adapter_names(tuner: nn.Module, adapter_names: object, batch_size: int | None) -> list[str]:
    """``adapter_names`` as a list, checked as peft checks LoRA's: a list of names, one per example, each a graft of
    the model or ``"__base__"``, no merged adapter, eval mode; and for grafts, no region still being learned."""
    if isinstance(adapter_names, str) or not isinstance(adapter_names, Sequence):
        raise TypeError(
            f"adapter_names must be a list of adapter names, one per example, got {type(adapter_names).__name__}: "
            f"{adapter_names!r}. Use e.g. adapter_names=['sst2', 'trec', '__base__']."
        )
    names = list(adapter_names)
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise TypeError(f"adapter_names must hold strings (adapter names or '__base__'), got {wrong[0]!r}.")
    if tuner.training:
        raise ValueError("Cannot pass `adapter_names` when the model is in training mode: call model.eval() first.")
    unknown = sorted({name for name in names if name != BASE} - set(tuner.peft_config))
    if unknown:
        raise ValueError(
            f"Trying to infer with non-existing adapter(s): {', '.join(unknown)}. Loaded adapters: "
            f"{sorted(tuner.peft_config)}; '__base__' asks for the pre-trained model."
        )
    if batch_size is not None and len(names) != batch_size:
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(names)} and {batch_size} respectively."
        )
    layers, _ = tuner._adapter_modules()
    if any(layer.merged for layer in layers):
        raise ValueError(
            "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
        )
    for name in set(names) - {BASE}:
        if any(layer.is_learning(name) for layer in layers):
            raise ValueError(
                f"Adapter {name!r} is still learning its region and cannot serve in a mixed batch: harden it first "
                "(model.harden_region())."
            )
    return names


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for key in ("input_ids", "inputs_embeds", "pixel_values", "input_features"):
        value = kwargs.get(key)
        if torch.is_tensor(value) and value.dim():
            return value.shape[0]
    if args and torch.is_tensor(args[0]) and args[0].dim():
        return args[0].shape[0]
    return None


class _Running:
    """The mixed batches in effect, nested ones included (changed only under WRITE_LOCK, by the thread holding it)."""

    depth = 0


_RUNNING = _Running()


@contextmanager
def mixed_batch_hooks(tuner: nn.Module, *args: Any, **kwargs: Any) -> Iterator[None]:
    """peft's ``_enable_peft_forward_hooks`` for grafts: with ``adapter_names`` in ``kwargs``, every graft layer and
    head of ``tuner``'s model serves each example with its own graft for the duration; without, a mixed batch in effect
    (a forward nested inside one) is suspended, so the nested forward sees the model's ordinary state."""
    adapter_names = kwargs.get("adapter_names")
    if adapter_names is None:
        if tuner.__dict__.get("mixed_batch") is None:  # set only under WRITE_LOCK, by the thread holding it
            yield
            return
        with WRITE_LOCK, _suspended(tuner):
            yield
        return
    # The checks run under the lock too: another thread's delete_adapter or load_adapter (which change the adapters
    # and modules read here) waits for the whole mixed forward, as for a single-graft one.
    with WRITE_LOCK:
        names = check_adapter_names(tuner, adapter_names, _batch_size(args, kwargs))
        num_beams = kwargs.get("num_beams")
        decoder_names = names
        if isinstance(num_beams, int) and num_beams > 1:  # generate repeats each input num_beams times, as in peft
            decoder_names = [name for name in names for _ in range(num_beams)]
        encoder = _encoder(tuner.model)
        encoder_modules = {id(m) for m in encoder.modules()} if encoder is not None else set()
        with suspended_writes() if _IN_EFFECT else nullcontext(), _suspended(tuner):
            delta = tuner.__dict__.get("mixed_batch_mode", DEFAULT_MIXED_BATCH_MODE) == "sparse_delta"
            scratch = None if _RUNNING.depth else tuner.__dict__.setdefault(SCRATCH, {})
            batches = {id(n): MixedBatch(n, delta, scratch=scratch) for n in (names, decoder_names)}
            layers, wrappers = tuner._adapter_modules()
            _RUNNING.depth += 1
            try:
                tuner.mixed_batch = batches[id(decoder_names)]
                for module in (*layers, *wrappers):
                    batch = batches[id(names) if id(module) in encoder_modules else id(decoder_names)]
                    if isinstance(module, ModulesToSaveWrapper):
                        module.forward = _head_forward(module, batch)
                    elif isinstance(module, AuxiliaryTrainingWrapper):
                        raise ValueError(
                            f"{type(module).__name__} does not support mixed-graft batches; only heads stored whole "
                            "(modules_to_save) do."
                        )
                    else:
                        module.mixed_batch = batch
                        if delta:
                            batch.unprepared.append(module)
                yield
            finally:
                _RUNNING.depth -= 1
                _clear(tuner)


@contextmanager
def _suspended(tuner: nn.Module) -> Iterator[None]:
    """The mixed batch in effect on ``tuner`` (if any) is lifted for the duration, and set again at exit."""
    if tuner.__dict__.get("mixed_batch") is None:
        yield
        return
    layers, wrappers = tuner._adapter_modules()
    saved = (
        tuner.mixed_batch,
        [layer.mixed_batch for layer in layers],
        [wrapper.__dict__.get("forward") for wrapper in wrappers],
    )
    _clear(tuner)
    try:
        yield
    finally:
        tuner.mixed_batch = saved[0]
        for layer, batch in zip(layers, saved[1], strict=True):
            layer.mixed_batch = batch
        for wrapper, forward in zip(wrappers, saved[2], strict=True):
            if forward is not None:
                wrapper.forward = forward


def _clear(tuner: nn.Module) -> None:
    layers, wrappers = tuner._adapter_modules()
    tuner.mixed_batch = None
    for layer in layers:
        layer.mixed_batch = None
    for wrapper in wrappers:
        wrapper.__dict__.pop("forward", None)


def _encoder(model: nn.Module) -> nn.Module | None:
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    return None if encoder is model else encoder


def layer_forward(layer: nn.Module, batch: MixedBatch, args: tuple, kwargs: dict, exact: bool = False) -> Any:
    """A graft layer's forward for a mixed batch: its base layer once per group of examples (see the module doc), or
    in the "sparse_delta" mode once for the batch where that applies (``exact``: per group whatever the mode)."""
    x, rest = args[0], args[1:]
    holders = _holders(layer, batch)
    if not holders:
        return layer.base_layer(*args, **kwargs)
    one_call = not exact and not rest and not kwargs and torch.is_tensor(x) and x.dim() > 1
    # With autograd on, the exact path (functional per group, as a single-graft forward): the deltas carry no gradient
    if batch.sparse_delta and one_call and x.shape[0] == len(batch.names) and not torch.is_grad_enabled():
        if id(layer) not in batch.deltas:  # every layer's at once (and this one's, if added since)
            pending = {id(module): module for module in (*batch.unprepared, layer) if id(module) not in batch.deltas}
            batch.unprepared = []
            prepare_sparse_deltas([(module, batch) for module in pending.values()])
        delta = batch.deltas[id(layer)]
        if (
            isinstance(delta, LayerDelta)
            and delta.density * math.prod(x.shape[1:-1]) <= sparse_delta.SPARSE_DELTA_MAX_WORK
            and not torch.is_autocast_enabled(x.device.type)  # it casts the base layer's inputs: the exact path then
        ):
            return delta.forward(layer.base_layer, x)
        if isinstance(delta, (LayerNormColumns, ExampleParameters)) and x.shape[-1] == delta.features:
            return delta.forward(layer, x, lambda: layer_forward(layer, batch, args, kwargs, exact=True))

    def run(name: str, inputs: torch.Tensor) -> torch.Tensor:
        if name not in holders:
            return layer.base_layer(inputs, *rest, **kwargs)
        plan = layer.in_place_plan((name,))
        if plan is not None:
            return plan.run(layer.base_layer, (inputs, *rest), kwargs)
        overrides = layer.effective_parameters([name])  # autograd on: as the single-graft forward does then
        return torch.func.functional_call(
            layer.base_layer, overrides, (inputs, *rest), kwargs, tie_weights=False, strict=False
        )

    return _combine(batch.groups(x.device), run, x, len(batch.names), type(layer.base_layer).__name__)


def prepare_sparse_deltas(layers: list[tuple[nn.Module, MixedBatch]]) -> None:
    """What each ``(layer, batch)`` runs with in the "sparse_delta" mode, into ``batch.deltas``
    (:func:`sparse_delta.prepare`: every layer of the batch at once, at the first call that uses one)."""
    with torch.no_grad():
        built = sparse_delta.prepare(
            [(layer, sorted(_holders(layer, batch)), batch.names) for layer, batch in layers],
            None if any(batch.scratch is None for _, batch in layers) else layers[0][1].scratch,
        )
    for (layer, batch), delta in zip(layers, built, strict=True):
        batch.deltas[id(layer)] = delta


def _holders(layer: nn.Module, batch: MixedBatch) -> frozenset[str]:
    """The grafts of ``batch`` with entries in ``layer`` (found once per batch)."""
    holders = batch.holders.get(id(layer))
    if holders is None:
        names = [name for name in batch.positions if name != BASE]
        holders = batch.holders[id(layer)] = frozenset().union(*(s.holding(names) for s in _source_layers(layer)))
    return holders


def _head_forward(wrapper: ModulesToSaveWrapper, batch: MixedBatch):
    """A ``modules_to_save`` wrapper's forward for a mixed batch: each group through its graft's copy of the module
    (the original where a graft stores none, or for ``"__base__"``)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if wrapper.disable_adapters:
            return wrapper.original_module(*args, **kwargs)
        holders = frozenset(name for name in batch.positions if name in wrapper.modules_to_save)
        if not holders:
            return wrapper.original_module(*args, **kwargs)
        what = type(wrapper.original_module).__name__
        if not args or any(torch.is_tensor(value) for value in (*args[1:], *kwargs.values())):
            _refuse_head(what, "takes its input as a keyword" if not args else "takes more than one tensor")

        def run(name: str, inputs: torch.Tensor) -> torch.Tensor:
            module = wrapper.modules_to_save[name] if name in holders else wrapper.original_module
            output = module(inputs, *args[1:], **kwargs)
            if not torch.is_tensor(output):
                _refuse_head(what, f"returns a {type(output).__name__}")
            return output

        return _combine(batch.groups(args[0].device), run, args[0], len(batch.names), what)

    return forward


def _refuse_head(what: str, why: str) -> None:
    raise TypeError(
        f"A module stored whole (modules_to_save) serves mixed-graft batches (adapter_names) only when it takes one "
        f"tensor with a batch dimension, as its first argument, and returns one tensor; this {what} {why}. Serve "
        "these grafts one at a time (set_adapter), or store only tensors of the module (a graft of its weights) "
        "rather than the module whole."
    )


def _source_layers(layer: nn.Module) -> list[nn.Module]:
    """The graft layers storing the entries of the tensors ``layer`` applies (itself, and those of tied tensors)."""
    return list({id(source): source for source, _ in layer._sources().values()}.values())


def _combine(groups: list[Group], run, x: torch.Tensor, batch_size: int, what: str) -> torch.Tensor:
    """``run(name, inputs)`` per group, put back in the examples' order. An input with a batch dimension of 1 while
    the batch has more examples (GPT-2's position ids) is shared: each group runs on all of it, and the output gets one
    row per example."""
    if not torch.is_tensor(x) or not x.dim() or x.shape[0] not in (batch_size, 1):
        got = x.shape[0] if torch.is_tensor(x) and x.dim() else type(x).__name__
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{batch_size} and {got} respectively (the input of a {what} layer)."
        )
    if len(groups) == 1:
        return run(groups[0][0], x)
    if x.shape[0] == 1 and batch_size > 1:
        outputs = [run(name, x) for name, _ in groups]
        row = torch.empty(batch_size, dtype=torch.int64)
        for number, (_, index) in enumerate(groups):
            row[index] = number
        return torch.cat(outputs).index_select(0, row.to(outputs[0].device))
    out = None
    for name, index in groups:
        inputs = x[index] if isinstance(index, slice) else x.index_select(0, index)
        if inputs.data_ptr() % _ALIGNMENT:  # a view inside the batch: CPU kernels round by the data's alignment
            inputs = inputs.clone()
        output = run(name, inputs)
        if out is None:
            out = output.new_empty((batch_size, *output.shape[1:]))
        if isinstance(index, slice):
            out[index] = output
        else:
            out.index_copy_(0, index, output)
    return out
