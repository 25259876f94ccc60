"""The ``"sparse_delta"`` mode of mixed-graft batches (``model.set_mixed_batch_mode("sparse_delta")``): a graft layer
runs its base layer once for the whole batch instead of once per group of examples (mixed_batch.py), in three ways.

- A ``Linear`` (or GPT-2 ``Conv1D``) layer whose grafts are sparse there for the call (:data:`SPARSE_DELTA_MAX_WORK`:
  decoding steps qualify where a prefill may not) adds each example's sparse delta to its outputs,
  ``y[:, r] += x[:, c] * d`` per entry (and ``d`` at a bias entry) (:class:`LayerDelta`). Its output differs from the
  exact one by floating-point rounding only: at most ``2 * gamma_n * sum_k |x_k| (|w_k| + |w'_k|) + u * |y|`` per
  output (``n`` the layer's input size, ``u`` the unit roundoff of the output dtype, ``gamma_n = n u / (1 - n u)``,
  ``w`` and ``w'`` the row of the base and of the grafted weight), the bound ``tests/test_mixed_batch.py`` checks.
- An ``nn.LayerNorm`` (fp32 or fp64 input) recomputes, from its kernel's mean and rstd, only the features where an
  example's graft changes its weight or bias, within the bound stated in :class:`LayerNormColumns`; the other features
  are bit for bit the exact path's.
- A layer whose grafted tensors are vectors over its input's last dimension (an RMSNorm's weight) gets one copy of
  them per example, its graft's values written in, as a ``(batch, 1, ..., features)`` tensor through
  ``functional_call`` (:class:`ExampleParameters`). Where the layer applies them element-wise, each example's output
  is bit for bit that of the exact path. This is checked on the layer's first call against the exact path; a layer
  that fails the check keeps the exact path.

Other layers keep the exact per-group path. Each graft's values on a layer are built once and kept with its one-graft
in-place plan (so for as long as the plan is current, and freed with it); a batch's are joined and indexed before the
forward (:func:`prepare`), with the base values under the entries compared for every layer at once: on a GPU, each
read of a result makes the host wait for the queue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .entries import graft_entries

SPARSE_DELTA_MAX_WORK = 0.02
"""A linear layer's call takes the delta path only where (the largest share of its weight's entries a graft holds) x
(tokens per example) is at most this: the deltas cost one gather and scatter per entry and token, the exact path one
base call per group. Set from RoBERTa-base batches of 32 x 128 with 8 grafts, where the delta path was faster at 0.01%
(1.28e-2 here) and slower at 0.1% (1.28e-1); BENCHMARKS.md, "Re-taken side by side (issue 38, second run)"."""

Values = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""One graft's values on a layer, per base tensor name: (flat indices, base values there when built, values: the
fp32 delta for a linear layer, the grafted values in the tensor's dtype for a vector layer)."""


def to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built index on ``device``: on CUDA through pinned memory without waiting (a plain copy from pageable
    memory would wait for the GPU's queue)."""
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


def linear_shape(base: nn.Module) -> tuple[int, int, bool] | None:
    """``(out, in, whether the weight is stored (in, out))`` of a plain ``nn.Linear`` or GPT-2 ``Conv1D``, else None."""
    if type(base).forward is nn.Linear.forward:
        return base.out_features, base.in_features, False
    if type(base).__name__ == "Conv1D" and hasattr(base, "nf") and base.weight.dim() == 2:
        return base.nf, base.weight.shape[0], True
    return None


def _kind(base: nn.Module) -> tuple | None:
    """What the mode can do with ``base``: ``("linear", shape)``, ``("layer_norm", features)`` (an ``nn.LayerNorm``
    over the last dimension, with a weight), ``("vector", features)`` (every parameter a vector of one length), or
    None."""
    shape = linear_shape(base)
    if shape is not None:
        return ("linear", shape)
    if type(base).forward is nn.LayerNorm.forward and len(base.normalized_shape) == 1 and base.weight is not None:
        return ("layer_norm", base.normalized_shape[0])
    sizes = {p.shape for p in base._parameters.values() if p is not None}
    if len(sizes) == 1 and len(next(iter(sizes))) == 1 and not base._modules:
        return ("vector", next(iter(sizes))[0])
    return None


def graft_values(plan, kind: tuple, device: torch.device) -> Values | None:
    """One graft's :data:`Values` on a layer from its one-graft in-place ``plan``, or None where the exact path is
    needed: on a linear layer a tensor other than its weight and bias, or a graft denser than
    :data:`SPARSE_DELTA_MAX_WORK` for a single token; on a vector layer a tensor of another shape."""
    values: Values = {}
    for parameters, attr, entries, scale, first in plan.writes:
        tensor = parameters[attr]
        if attr in values or (kind[0] == "linear" and attr not in ("weight", "bias")):
            return None
        if kind[0] != "linear" and tuple(tensor.shape) != (kind[1],):
            return None
        if kind[0] == "linear" and attr == "weight":
            out_features, in_features, _ = kind[1]
            if entries[0].numel() > SPARSE_DELTA_MAX_WORK * out_features * in_features:
                return None
        original = tensor.data.take(entries[0])
        grafted = graft_entries(original, entries, first, scale)
        value = grafted.float() - original.float() if kind[0] == "linear" else grafted
        at = entries[0].to(torch.int64)
        if kind[0] == "linear" and attr == "weight":
            order = _along_wider_side(at, kind[1])
            at, original, value = at[order], original[order], value[order]
        values[attr] = tuple(t.to(device) for t in (at, original, value))
    return values


def _along_wider_side(at: torch.Tensor, shape: tuple[int, int, bool]) -> torch.Tensor:
    """The order of a linear weight's flat indices ``at`` by their index into the wider of the layer's input and
    output, so that :meth:`LayerDelta.add_to` walks the wider of its two rows (``x``'s or ``out``'s) in increasing
    order: a gather or scatter at random places in a 3,072-wide row costs twice as much on a CPU."""
    out_features, in_features, transposed = shape
    rows, columns = (at % out_features, at // out_features) if transposed else (at // in_features, at % in_features)
    key = columns * out_features + rows if in_features > out_features else rows * in_features + columns
    return torch.argsort(key, stable=True)


def _joined(grafts: list[Values]) -> dict[str, Any]:
    """Per base tensor that a graft changes: the grafts' (indices, base values, values) joined graft after graft, and
    each graft's number of entries (ints)."""
    joined = {}
    for attr in dict.fromkeys(attr for graft in grafts for attr in graft):
        present = next(graft[attr] for graft in grafts if attr in graft)
        empty = tuple(t.new_empty(0) for t in present)
        parts = [graft.get(attr, empty) for graft in grafts]
        joined[attr] = (*(torch.cat(column) for column in zip(*parts, strict=True)), [p[0].numel() for p in parts])
    return joined


def _changed(layer: nn.Module, joined: dict[str, Any]) -> torch.Tensor | None:
    """Whether a base value under an entry is no longer the one the values were taken against (they move with it: by
    rounding, and wholly at an entry stored exactly; a write through ``.data`` moves no version counter, so the values
    are compared, one gather per tensor and batch). A boolean tensor on the layer's device, read back with every other
    layer's at once (:func:`_read_flags`); None where there is nothing to compare."""
    parameters = layer.base_layer._parameters
    flags = [(parameters[attr].data.take(at) != original).any() for attr, (at, original, *_) in joined.items()]
    return torch.stack(flags).any() if flags else None


def _read_flags(flags: list[torch.Tensor | None]) -> list[bool]:
    """``flags`` as bools, read back with one transfer per device (on a GPU each read waits for its queue)."""
    values = [False] * len(flags)
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        if flag is not None:
            by_device.setdefault(flag.device, []).append(i)
    for positions in by_device.values():
        for i, value in zip(positions, torch.stack([flags[i] for i in positions]).tolist(), strict=True):
            values[i] = value
    return values


def _pairs(counts: list[int], graft: torch.Tensor) -> tuple[list[torch.Tensor], tuple[int, bool]]:
    """The (example, entry) pairs of a batch, on the host: each example with every entry of its graft (``graft``: per
    example, the position of its graft in the joined order, -1 for none), entries numbered in the joined order.
    Returns ``[examples, entries, slots, lengths]`` and ``(width, padded)``: the pairs laid out one row per example,
    ``width`` wide (its largest number of pairs), a pair at flat position ``slot``; ``lengths``: each example's
    number of pairs; ``padded``: whether some row has fewer."""
    counts = torch.tensor(counts, dtype=torch.int64)
    held = graft.clamp(min=0)
    lengths = torch.where(graft >= 0, counts[held], 0)
    starts = lengths.cumsum(0) - lengths
    shift = (counts.cumsum(0) - counts)[held] - starts  # graft's start - pair's start
    pairs = int(lengths.sum())
    examples = torch.arange(graft.numel()).repeat_interleave(lengths, output_size=pairs)
    positions = torch.arange(pairs)
    width = int(lengths.max()) if lengths.numel() else 0
    slots = examples * width + positions - starts.repeat_interleave(lengths, output_size=pairs)
    entries = positions + shift.repeat_interleave(lengths, output_size=pairs)
    return [examples, entries, slots, lengths], (width, bool((lengths < width).any()))


def _gathered(joined: dict[str, Any], graft: tuple[int, ...], device: torch.device, memo: dict) -> dict[str, tuple]:
    """Per base tensor, the batch's ``(examples, flat indices, values, slots, lengths, (width, padded))`` over its
    (example, entry) pairs (see :func:`_pairs`), gathered by one index per tensor whatever the number of grafts
    (``graft``: per example, the position of its graft in the joined order, -1 for none). The index is built on the
    host and sent in one copy, once per batch for all layers with the same grafts and entry counts (``memo``)."""
    counts = tuple(tuple(counts) for *_, counts in joined.values())
    key = (graft, counts, device)
    if key not in memo:
        numbers = torch.tensor(graft, dtype=torch.int64)
        built = [_pairs(list(layer_counts), numbers) for layer_counts in counts]
        parts = [index for indices, _ in built for index in indices]
        pieces = to_device(torch.cat(parts), device).split([part.numel() for part in parts])
        memo[key] = pieces, [layout for _, layout in built]
    pieces, layouts = memo[key]
    out = {}
    for number, (attr, (at, _, value, _)) in enumerate(joined.items()):
        examples, entry, slots, lengths = pieces[4 * number : 4 * number + 4]
        out[attr] = examples, at[entry], value[entry], slots, lengths, layouts[number]
    return out


@dataclass
class LayerDelta:
    """Every group's sparse delta on one linear layer, one row per example: its weight entries add
    ``x[example, ..., columns[example, k]] * weight[example, k]`` to ``out[example, ..., rows[example, k]]`` and its
    bias entries ``bias[example, k]`` to ``out[example, ..., bias_rows[example, k]]``. Rows are padded to the
    example with the most entries, with zeros (``padding``: where the weight part is padding, None where none is)."""

    columns: torch.Tensor
    rows: torch.Tensor
    weight: torch.Tensor
    padding: torch.Tensor | None
    bias_rows: torch.Tensor
    bias: torch.Tensor
    density: float = 0.0  # the largest share of the weight's entries one graft holds

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (the base layer's output on ``x``) plus the deltas: one gather from ``x`` and one ``scatter_add_``
        into ``out`` along the features, for the whole batch whatever the number of groups (a loop over the groups
        would launch a few kernels per group and layer, most of a decoding step's time)."""
        batch_size = x.shape[0]
        x3 = x.reshape(batch_size, -1, x.shape[-1])
        out = out.contiguous()
        out3 = out.view(batch_size, -1, out.shape[-1])
        tokens = x3.shape[1]
        if self.weight.numel():
            values = torch.gather(x3, 2, self.columns[:, None].expand(-1, tokens, -1)).float() * self.weight[:, None]
            if self.padding is not None:  # x * 0 is not 0 where x is infinite
                values.masked_fill_(self.padding[:, None], 0.0)
            out3.scatter_add_(2, self.rows[:, None].expand(-1, tokens, -1), values.to(out.dtype))
        if self.bias.numel():
            bias = self.bias[:, None].expand(-1, tokens, -1).to(out.dtype)
            out3.scatter_add_(2, self.bias_rows[:, None].expand(-1, tokens, -1), bias)
        return out


def _per_example(parts: tuple, batch_size: int) -> tuple[torch.Tensor, ...]:
    """``(rows or columns..., values)`` of a tensor's pairs, laid out one row per example (see :func:`_pairs`)."""
    *columns, slots, lengths, (width, padded) = parts
    laid = []
    for column in columns:
        out = column.new_zeros(batch_size * width)
        laid.append(out.index_copy_(0, slots, column).view(batch_size, width))
    padding = torch.arange(width, device=lengths.device) >= lengths[:, None] if padded else None
    return (*laid, padding)


def _layer_delta(joined: dict[str, Any], graft: tuple[int, ...], shape: tuple, memo: dict) -> LayerDelta:
    out_features, in_features, transposed = shape
    batch_size = len(graft)
    device = joined["weight"][0].device if "weight" in joined else joined["bias"][0].device
    gathered = _gathered(joined, graft, device, memo)
    empty = torch.empty(batch_size, 0, dtype=torch.int64, device=device)
    columns, rows, weight, padding = empty, empty, empty.float(), None
    if "weight" in gathered:
        _, at, value, *layout = gathered["weight"]
        if transposed:  # Conv1D stores (in, out)
            rows, columns = at % out_features, at // out_features
        else:
            rows, columns = at // in_features, at % in_features
        columns, rows, weight, padding = _per_example((columns, rows, value, *layout), batch_size)
    bias_rows, bias = empty, empty.float()
    if "bias" in gathered:
        _, at, value, *layout = gathered["bias"]
        bias_rows, bias, _ = _per_example((at, value, *layout), batch_size)
    density = max(joined["weight"][3]) / (out_features * in_features) if "weight" in joined else 0.0
    return LayerDelta(columns, rows, weight, padding, bias_rows, bias, density)


EXACT_WITH_EXAMPLE_PARAMETERS = "_example_parameters_exact"
"""The attribute of a graft layer recording whether :class:`ExampleParameters` gave its exact outputs (None: not
checked yet)."""


@dataclass
class ExampleParameters:
    """A vector layer's tensors per example, ``(batch, features)`` each, the example's graft's values written in."""

    tensors: dict[str, torch.Tensor]
    features: int

    def forward(self, layer: nn.Module, x: torch.Tensor, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The base layer's output with each example's tensors, where that gave the exact path's outputs on the
        layer's first call (``exact()``, compared bit for bit then); else ``exact()``."""
        verdict = layer.__dict__.get(EXACT_WITH_EXAMPLE_PARAMETERS)
        if verdict is False:
            return exact()
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.features,)
        overrides = {attr: tensor.view(shape) for attr, tensor in self.tensors.items()}
        try:
            out = torch.func.functional_call(layer.base_layer, overrides, (x,), tie_weights=False, strict=False)
        except RuntimeError:  # e.g. nn.LayerNorm: its kernel takes a weight of the normalized shape only
            if verdict:
                raise
            out = None
        if verdict is None:
            expected = exact()
            verdict = torch.is_tensor(out) and out.shape == expected.shape and torch.equal(out, expected)
            layer.__dict__[EXACT_WITH_EXAMPLE_PARAMETERS] = verdict
            return expected
        return out


def _per_example_copy(tensor: torch.Tensor, batch_size: int, pairs: tuple | None) -> torch.Tensor:
    """``(batch_size, features)``: a copy of the vector ``tensor`` per example, the values of ``pairs`` (an entry of
    :func:`_gathered`, None for none) written into their examples' copies."""
    copies = tensor.data.expand(batch_size, tensor.shape[-1]).clone()
    if pairs is not None:
        examples, at, value, *_ = pairs
        copies.index_put_((examples, at), value)
    return copies


def _example_parameters(layer: nn.Module, joined: dict[str, Any], graft: tuple[int, ...], features: int, memo: dict):
    parameters = layer.base_layer._parameters
    device = next(iter(joined.values()))[0].device
    gathered = _gathered(joined, graft, device, memo)
    tensors = {attr: _per_example_copy(parameters[attr], len(graft), pairs) for attr, pairs in gathered.items()}
    return ExampleParameters(tensors, features)


@dataclass
class LayerNormColumns:
    """An ``nn.LayerNorm`` run once for the batch, then, at the features where an example's graft changes its weight or
    bias, that output recomputed as ``(x - mean) * rstd * weight + bias`` with the example's values and the kernel's
    own ``mean`` and ``rstd``: one row of ``columns`` per example (padded by its first column again), its ``weight``
    and ``bias`` there (``empty``: the examples without any, whose row keeps the kernel's output; None if none). The
    other features are the kernel's output, bit for bit the exact path's; the recomputed ones differ from it by the
    arrangement of the arithmetic only: at most ``4 u ((|x| + |mean|) rstd |weight| + |bias|) + u |y|`` (``u`` the unit
    roundoff of fp32). Float32 and float64 inputs only: the kernel returns ``mean`` and ``rstd`` in the input's dtype,
    too coarse below fp32, so other inputs take the exact path."""

    columns: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    empty: torch.Tensor | None
    features: int

    def forward(self, layer: nn.Module, x: torch.Tensor, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
        base = layer.base_layer
        if x.dtype not in (torch.float32, torch.float64):
            return exact()
        out, mean, rstd = torch.native_layer_norm(x, base.normalized_shape, base.weight, base.bias, base.eps)
        batch_size = x.shape[0]
        x3, out3 = x.reshape(batch_size, -1, self.features), out.view(batch_size, -1, self.features)
        columns = self.columns[:, None].expand(-1, x3.shape[1], -1)
        normalized = (torch.gather(x3, 2, columns) - mean.view(batch_size, -1, 1)) * rstd.view(batch_size, -1, 1)
        values = normalized * self.weight[:, None].to(x.dtype) + self.bias[:, None].to(x.dtype)
        if self.empty is not None:
            values = torch.where(self.empty[:, None, None], torch.gather(out3, 2, columns), values)
        return out3.scatter(2, columns, values).view_as(out)


def _layer_norm_columns(layer: nn.Module, joined: dict[str, Any], graft: tuple[int, ...], memo: dict):
    base = layer.base_layer
    device, features, batch_size = base.weight.device, base.normalized_shape[0], len(graft)
    gathered = _gathered(joined, graft, device, memo)
    laid = [_per_example((at, *layout), batch_size) for _, at, _, *layout in gathered.values()]
    columns = torch.cat([column for column, _ in laid], dim=1)
    empty = None  # the examples without an entry here: their rows are all padding
    if any(padding is not None for _, padding in laid):
        padding = torch.cat([torch.zeros_like(c, dtype=torch.bool) if p is None else p for c, p in laid], dim=1)
        # A padded slot writes the value of its example's first entry again: at a column of its own it would race
        # with a real slot of that column (scatter's order among equal indices is undefined).
        first = columns.gather(1, (~padding).to(torch.uint8).argmax(1, keepdim=True))
        columns = torch.where(padding, first, columns)
        empty = padding.all(1)
    weight = _per_example_copy(base.weight, batch_size, gathered.get("weight")).gather(1, columns)
    if base.bias is None:
        bias = torch.zeros_like(weight)
    else:
        bias = _per_example_copy(base.bias, batch_size, gathered.get("bias")).gather(1, columns)
    return LayerNormColumns(columns, weight, bias, empty, features)


def prepare(
    layers: list[tuple[nn.Module, list[str], list[str]]],
) -> list[LayerDelta | LayerNormColumns | ExampleParameters | None]:
    """For each ``(layer, its grafts in the batch, the batch's graft per example)``, what the mode runs it with (None:
    the exact path), built before the forward, so that the base values of every layer are compared with one read per
    device."""
    found, results = [], [None] * len(layers)
    for number, (layer, holders, names) in enumerate(layers):
        kind = _kind(layer.base_layer)
        if kind is not None and kind[0] == "vector" and layer.__dict__.get(EXACT_WITH_EXAMPLE_PARAMETERS) is False:
            kind = None  # checked: not exact with per-example tensors
        joined = _joined_for(layer, holders, kind) if holders and kind is not None else None
        if joined is not None:
            found.append((number, layer, holders, names, kind, joined))
    changed = _read_flags([_changed(layer, joined) for _, layer, _, _, _, joined in found])
    memo = {}  # the batch's (example, entry) index per set of grafts and entry counts, on its device
    for (number, layer, holders, names, kind, joined), again in zip(found, changed, strict=True):
        if again:  # rare: built again against the base as it is now
            joined = _joined_for(layer, holders, kind, rebuild=True)
        position = {name: i for i, name in enumerate(holders)}
        graft = tuple(position.get(name, -1) for name in names)
        if kind[0] == "linear":
            results[number] = _layer_delta(joined, graft, kind[1], memo)
        elif kind[0] == "layer_norm":
            results[number] = _layer_norm_columns(layer, joined, graft, memo)
        else:
            results[number] = _example_parameters(layer, joined, graft, kind[1], memo)
    return results


def _joined_for(layer: nn.Module, holders: list[str], kind: tuple, rebuild: bool = False) -> dict[str, Any] | None:
    """The joined :data:`Values` of ``holders`` on ``layer`` (``rebuild``: each built anew), or None where the exact
    path is needed. Each graft's are kept with its in-place plan (``plan.sparse_delta``)."""
    parameters = [p for p in layer.base_layer._parameters.values() if p is not None]
    if not parameters or parameters[0].device.type == "meta":
        return None
    plans = [layer.in_place_plan((name,)) for name in holders]
    if any(plan is None for plan in plans):
        return None
    for plan in plans:
        if rebuild or plan.sparse_delta is None or plan.sparse_delta[0] != kind:
            values = graft_values(plan, kind, parameters[0].device)
            own = all(parameters_ is layer.base_layer._parameters for parameters_, *_ in plan.writes)
            plan.sparse_delta = (kind, values if own else None)
    values = [plan.sparse_delta[1] for plan in plans]
    if any(value is None for value in values):
        return None
    cached = layer.__dict__.get(_JOINED, ((), None))  # the last batch's, while its grafts' values are the same objects
    if len(cached[0]) == len(values) and all(a is b for a, b in zip(cached[0], values, strict=True)):
        return cached[1]
    joined = _joined(values)
    layer.__dict__[_JOINED] = (values, joined)
    return joined


_JOINED = "_sparse_delta_joined"
"""The attribute of a graft layer holding the last batch's joined values, with the values they were joined from: one
set per layer, reused while a batch brings the same grafts (a join is a copy of every graft's values there)."""
