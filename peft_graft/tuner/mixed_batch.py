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
bit-exact (``tests/test_mixed_batch.py``). So that the groups are slices of each layer's input (no gather and scatter
per layer, a plain ``nn.Linear`` writing each group's product straight into its slice of the output), the model's
forward puts the examples side by side by graft and its outputs back in their order (:func:`grouped_call`), where
that cannot change what the caller gets. A head stored whole (``modules_to_save``, e.g. a classification head per
task) runs this way in both modes: each group through its graft's copy.

The state lives on the layers (``GraftLayer.mixed_batch``) and on the tuner for the duration of the forward or
``generate`` and is set and cleared under :data:`~peft_graft.tuner.in_place.WRITE_LOCK`, so a mixed batch keeps the
single-graft path's guarantees: threads run one at a time, a forward nested inside it (a hook calling the model without
``adapter_names``) runs in the model's ordinary state, and the base tensors get their values back bit for bit, also
after an error.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn
from transformers.cache_utils import Cache

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
    # whether the model's forward may put the examples in grouped order first (:func:`grouped_call`): one batch for
    # every layer (not beam search's encoder batch beside its decoder batch)
    regroupable: bool = False
    positions: dict[str, list[int]] = field(default_factory=dict)
    holders: dict[int, frozenset[str]] = field(default_factory=dict)  # by id(layer): the grafts with entries there
    # by id(layer), in the "sparse_delta" mode: what the layer runs with (None: the exact path)
    deltas: dict[int, LayerDelta | LayerNormColumns | ExampleParameters | None] = field(default_factory=dict)
    # in the "sparse_delta" mode, the layers whose deltas are not built yet: all at once, at the first layer call that
    # uses one (none does while autograd is on, so nothing is built then)
    unprepared: list[nn.Module] = field(default_factory=list)
    delta_layers: list[nn.Module] = field(default_factory=list)  # every layer that may use one
    # the model's intermediate results per device (sparse_delta.Scratch), shared by its layers; None in a batch nested
    # inside another (from a hook), which leaves the layers' kept buffers alone
    scratch: dict[torch.device, Scratch] | None = None
    _groups: dict[torch.device, list[Group]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for position, name in enumerate(self.names):
            self.positions.setdefault(name, []).append(position)

    def grouped_order(self) -> list[int] | None:
        """The example positions with each name's examples side by side (names by first appearance, examples in batch
        order), or None where they already are."""
        order = [position for positions in self.positions.values() for position in positions]
        return None if order == list(range(len(order))) else order

    def regroup(self, order: list[int]) -> None:
        """The batch with its examples in ``order``: what depends on their order is found again."""
        self.names = [self.names[position] for position in order]
        self.positions, self._groups, self.deltas = {}, {}, {}
        self.unprepared = list(self.delta_layers)
        self.__post_init__()

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


BATCH_INPUTS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "position_ids",
        "inputs_embeds",
        "pixel_values",
        "pixel_mask",
        "input_features",
        "input_values",
        "decoder_input_ids",
        "decoder_attention_mask",
        "decoder_position_ids",
        "decoder_inputs_embeds",
    }
)
"""The forward arguments :func:`grouped_call` reorders (those with one row per example; a row shared by the batch, as
GPT-2's position ids of shape ``(1, length)``, stays as it is). A tensor passed under any other name keeps the batch
in its order."""


def grouped_call(batch: MixedBatch, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[int], torch.Tensor] | None:
    """``(args, kwargs, order, inverse)``: the call with the examples in ``order`` (``batch.grouped_order()``), so
    that each graft layer runs its groups on slices of its input and writes them into slices of its output (no gather
    and scatter per layer); the output indexed by ``inverse`` along the batch dimension (:func:`in_batch_order`) is in
    the examples' order. None (the batch runs in its order) where the examples are already grouped, and wherever
    reordering could change what the caller gets: ``labels`` (the loss sums over the examples in their order),
    ``past_key_values`` (kept in the batch's order), or a tensor argument not in :data:`BATCH_INPUTS`."""
    order = batch.grouped_order() if batch.regroupable else None
    if order is None or len(args) > 1 or any(kwargs.get(key) is not None for key in ("labels", "past_key_values")):
        return None
    size = len(batch.names)
    for value in (*args, *kwargs.values()):
        if value is not None and not isinstance(value, (bool, int, float, str, torch.Tensor)):
            return None
    if any(torch.is_tensor(value) and key not in BATCH_INPUTS for key, value in kwargs.items()):
        return None
    tensors = [value for value in (*args, *kwargs.values()) if torch.is_tensor(value)]
    if not tensors or any(not value.dim() or value.shape[0] not in (size, 1) for value in tensors):
        return None
    index = torch.tensor(order, dtype=torch.int64)
    indices: dict[torch.device, torch.Tensor] = {}

    def grouped(value: Any) -> Any:
        if not torch.is_tensor(value) or value.shape[0] != size:
            return value
        if value.device not in indices:
            indices[value.device] = to_device(index, value.device)
        return value.index_select(0, indices[value.device])

    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(size)
    kwargs = {key: grouped(value) for key, value in kwargs.items()}
    return tuple(grouped(value) for value in args), kwargs, order, inverse


def _grouping_forward(tuner: nn.Module, forward: Callable) -> Callable:
    """The model's ``forward`` for the duration of a mixed batch: each call with the examples grouped by graft where
    :func:`grouped_call` allows (the batch regrouped for the call, and back after it), its output in the examples'
    order. Both ways peft calls the model go through it: the tuner's ``forward`` and ``PeftModel``'s direct call. Only
    the thread running the mixed batch regroups it: another thread's call (waiting for the write lock at its first
    graft layer) runs as it is."""
    owner = threading.get_ident()

    @functools.wraps(forward)
    def grouping_forward(*args: Any, **kwargs: Any) -> Any:
        batch = tuner.__dict__.get("mixed_batch")  # None while a nested forward suspends it
        mine = batch is not None and threading.get_ident() == owner
        grouped = grouped_call(batch, args, kwargs) if mine else None
        if grouped is None:
            return forward(*args, **kwargs)
        args, kwargs, order, inverse = grouped
        batch.regroup(order)
        try:
            return in_batch_order(forward(*args, **kwargs), inverse)
        finally:
            batch.regroup(inverse.tolist())

    return grouping_forward


def in_batch_order(output: Any, inverse: torch.Tensor) -> Any:
    """A forward's output (a ``ModelOutput``, tuple, dict or tensor) with every tensor of one row per example, and a
    ``transformers`` cache, put back in the examples' order (``inverse`` from :func:`grouped_call`)."""
    size = inverse.numel()
    if torch.is_tensor(output):
        if not output.dim() or output.shape[0] != size:
            return output
        return output.index_select(0, to_device(inverse, output.device))
    if output is None or isinstance(output, (bool, int, float, str)):
        return output
    if isinstance(output, dict):  # a ModelOutput (an OrderedDict) sets its attribute with its item
        for key, value in list(output.items()):
            output[key] = in_batch_order(value, inverse)
        return output
    if isinstance(output, (tuple, list)) and type(output) in (tuple, list):
        return type(output)(in_batch_order(value, inverse) for value in output)
    if isinstance(output, Cache):  # a decoder's keys and values, one row per example
        output.reorder_cache(inverse)
        return output
    raise TypeError(
        f"A mixed-graft batch ran with its examples grouped by graft, and its output holds a {type(output).__name__}, "
        "which cannot be put back in the examples' order. Pass the examples grouped by graft (each graft's examples "
        "next to each other in adapter_names), which runs the batch as it is."
    )


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
            batches[id(names)].regroupable = len(batches) == 1
            layers, wrappers = tuner._adapter_modules()
            model_forward = tuner.model.__dict__.get("forward")  # accelerate's hooks set one
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
                            batch.delta_layers.append(module)
                for batch in batches.values():
                    batch.unprepared = list(batch.delta_layers)
                tuner.model.forward = _grouping_forward(tuner, model_forward or tuner.model.forward)
                yield
            finally:
                _RUNNING.depth -= 1
                _clear(tuner)
                if model_forward is None:
                    tuner.model.__dict__.pop("forward", None)
                else:
                    tuner.model.forward = model_forward


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

    groups = batch.groups(x.device)
    if not rest and not kwargs and _linear_by_slices_applies(layer.base_layer, x, groups, len(batch.names)):
        plans = {name: layer.in_place_plan((name,)) for name in holders}
        if all(plan is not None for plan in plans.values()):
            return _linear_by_slices(layer.base_layer, plans, groups, x)
    return _combine(groups, run, x, len(batch.names), type(layer.base_layer).__name__)


def _linear_by_slices_applies(base: nn.Module, x: torch.Tensor, groups: list[Group], batch_size: int) -> bool:
    """Whether :func:`_linear_by_slices` runs ``base`` on ``x``: a plain ``nn.Linear`` (no hooks, its own forward) in
    fp32 or fp64 on the CPU, without autograd or autocast, every group a slice of the batch."""
    return (
        type(base).forward is nn.Linear.forward
        and "forward" not in base.__dict__  # accelerate's hooks replace it
        and not (base._forward_pre_hooks or base._forward_hooks)
        and not (nn.modules.module._global_forward_pre_hooks or nn.modules.module._global_forward_hooks)
        and torch.is_tensor(x)
        and x.dim() > 1
        and x.shape[0] == batch_size
        and x.is_contiguous()
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and all(tensor is None or tensor.dtype == x.dtype for tensor in (base.weight, base.bias))
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
        and all(isinstance(index, slice) for _, index in groups)
    )


def _linear_by_slices(base: nn.Linear, plans: dict, groups: list[Group], x: torch.Tensor) -> torch.Tensor:
    """A linear layer's mixed-batch output with each group's product written straight into its slice of the output
    (``out=``, the kernel ``F.linear`` calls, on the same rows), the group's graft written in place around it: no copy
    of each group's output (measured with MiniLM's matrices at 256 x 17 in four groups: 1.07-1.08x one product over
    the batch, against 1.10-1.27x with the copies)."""
    rows = math.prod(x.shape[1:-1])
    out = x.new_empty((*x.shape[:-1], base.out_features))
    flat_x, flat_out = x.view(-1, x.shape[-1]), out.view(-1, base.out_features)
    for name, index in groups:
        part = slice(index.start * rows, index.stop * rows)
        inputs, outputs = flat_x[part], flat_out[part]
        inputs = _aligned(inputs)
        target = outputs if outputs.data_ptr() % _ALIGNMENT == 0 else torch.empty_like(outputs)
        plan = plans.get(name)
        if plan is None:
            _linear_into(base, inputs, target)
        else:
            plan.run(_linear_into, (base, inputs, target), {})
        if target is not outputs:
            outputs.copy_(target)
    return out


def _linear_into(base: nn.Linear, inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``F.linear(inputs, base.weight, base.bias)`` written into ``out``, by the same kernel (2-D inputs)."""
    if base.bias is None:
        return torch.mm(inputs, base.weight.t(), out=out)
    return torch.addmm(base.bias, inputs, base.weight.t(), out=out)


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


def _aligned(inputs: torch.Tensor) -> torch.Tensor:
    """A group's rows as a fresh copy where their view inside the batch is not aligned as an allocation is: CPU kernels
    round by the data's alignment."""
    return inputs.clone() if inputs.data_ptr() % _ALIGNMENT else inputs


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
        inputs = _aligned(inputs)
        output = run(name, inputs)
        if out is None:
            out = output.new_empty((batch_size, *output.shape[1:]))
        if isinstance(index, slice):
            out[index] = output
        else:
            out.index_copy_(0, index, output)
    return out
