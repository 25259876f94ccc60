"""The ``"sparse_delta"`` mode of mixed-graft batches (``model.set_mixed_batch_mode("sparse_delta")``): a graft layer
runs its base layer once for the whole batch instead of once per group of examples (mixed_batch.py), in three ways.

- A ``Linear`` (or GPT-2 ``Conv1D``) layer whose grafts are sparse there for the call (:data:`SPARSE_DELTA_MAX_WORK`:
  decoding steps qualify where a prefill may not) starts each example's outputs from its graft's bias, adds its sparse
  weight delta, ``y[:, r] += x[:, c] * d`` per entry, then the base product over the whole batch
  (:class:`LayerDelta`). Its output differs from the exact one by floating-point rounding only: at most
  ``2 * gamma_n * sum_k |x_k| (|w_k| + |w'_k|) + u * |y|`` per output (``n`` the layer's input size, ``u`` the unit
  roundoff of the output dtype, ``gamma_n = n u / (1 - n u)``, ``w`` and ``w'`` the row of the base and of the grafted
  weight), the bound ``tests/test_mixed_batch.py`` checks.
- An ``nn.LayerNorm`` (fp32 or fp64 input) recomputes, from its kernel's mean and rstd, only the features where an
  example's graft changes its weight or bias, within the bound stated in :class:`LayerNormColumns`; the other features
  are bit for bit the exact path's.
- A layer whose grafted tensors are vectors over its input's last dimension (an RMSNorm's weight) gets one copy of
  them per example, its graft's values written in, as a ``(batch, 1, ..., features)`` tensor through
  ``functional_call`` (:class:`ExampleParameters`). Where the layer applies them element-wise, each example's output
  is bit for bit that of the exact path. This is checked on the layer's first call against the exact path; a layer
  that fails the check keeps the exact path.

Other layers keep the exact per-group path. Each graft's values on a layer are built once and kept with its one-graft
in-place plan (so for as long as the plan is current, and freed with it). A layer's grafts are joined into padded
tables, one row per graft (:class:`Joined`), kept while batches bring the same grafts; before the forward
(:func:`prepare`) a batch picks its examples' rows, a few ``index_select`` calls per layer, and the base values under
the entries, and the grafts' own values, are compared bit for bit with those the tables were built from, for every
layer at once (a write through ``.data`` moves no version counter): on a GPU each kernel launch costs host time, and
each read of a result makes the host wait for the queue. What a batch selects and computes goes into tensors kept per
layer and batch size and written in place (:class:`Buffers`), so that the layers' calls allocate only their outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..sharding import as_bits
from .entries import graft_entries

SPARSE_DELTA_MAX_WORK = 0.02
"""A linear layer's call takes the delta path only where (the largest share of its weight's entries a graft holds) x
(tokens per example) is at most this: the deltas cost one gather and scatter per entry and token, the exact path one
base call per group. Set from RoBERTa-base batches of 32 x 128 with 8 grafts, where the delta path was faster at 0.01%
(1.28e-2 here) and slower at 0.1% (1.28e-1); BENCHMARKS.md at 64e350c, "Re-taken side by side (issue 38, second
run)"."""

Values = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""One graft's values on a layer, per base tensor name: (flat indices, base values there when built, values: the
delta for a linear layer's weight, in fp32 or the tensor's dtype where wider; the grafted values in the tensor's dtype
for a linear layer's bias and a vector layer)."""


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
        work = torch.promote_types(tensor.dtype, torch.float32)  # float64 stays float64
        value = grafted.to(work) - original.to(work) if kind[0] == "linear" and attr == "weight" else grafted
        at = entries[0].to(torch.int64)
        if kind[0] == "linear" and attr == "weight":
            order = _by_column(at, kind[1])
            at, original, value = at[order], original[order], value[order]
        values[attr] = tuple(t.to(device) for t in (at, original, value))
    return values


def _rows_and_columns(at: torch.Tensor, shape: tuple[int, int, bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The output rows and input columns of a linear weight's flat indices ``at``."""
    out_features, in_features, transposed = shape
    return (at % out_features, at // out_features) if transposed else (at // in_features, at % in_features)


def _by_column(at: torch.Tensor, shape: tuple[int, int, bool]) -> torch.Tensor:
    """The order of a linear weight's flat indices ``at`` by input column, then row: :meth:`LayerDelta.add_deltas`
    gathers from each row of ``x`` in increasing order (then puts the products in row order to add them to ``out``,
    also in increasing order: on a CPU a gather or scatter at random places in a row costs up to 1.4x as much)."""
    rows, columns = _rows_and_columns(at, shape)
    return torch.argsort(columns * shape[0] + rows, stable=True)


@dataclass
class Joined:
    """A layer's grafts joined graft after graft, kept while a batch brings the same grafts (:data:`_JOINED`): per base
    tensor the flat indices ``at`` of every graft's entries, the base values there when built (``original``,
    compared with the base on every batch, :func:`_changed_layers`), the values (:data:`Values`), each graft's number of
    entries (``counts``), and ``tables``: one padded row per graft and a last row for none, laid out for the kind of
    layer (:func:`_tables`), so that a batch picks its examples' rows with one ``index_select`` per table."""

    at: dict[str, torch.Tensor]
    original: dict[str, torch.Tensor]
    value: dict[str, torch.Tensor]
    counts: dict[str, list[int]]
    tables: dict[str, torch.Tensor]
    grafts: int
    # the grafts' own values the joined values were built from (the in-place plans' views of the graft tensors), and
    # a copy of them then, both per (device, dtype): compared on every batch (:func:`_changed_layers`)
    sources: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    buffers: Buffers | None = None  # the batches' tensors (:class:`Buffers`), for the last batch size and device

    @property
    def device(self) -> torch.device:
        return next(iter(self.at.values())).device

    def lengths(self, *attrs: str) -> list[int]:
        """Per table row (each graft, then none), its number of entries in the base tensors ``attrs``."""
        return [sum(self.counts[a][n] for a in attrs if a in self.counts) for n in range(self.grafts)] + [0]


@dataclass
class Buffers:
    """A layer's tensors for its batches, kept with its :class:`Joined` (so for one set of grafts) and written in place
    by each batch: the examples' rows of the joined tables (selected again only when the examples' grafts change:
    ``graft``, the graft numbers they hold) and the copies of the base's vectors with each graft's values (written on
    every batch: they follow the base). One tensor per name, replaced when a batch needs another shape or dtype; another
    batch size or device replaces them all, another set of grafts drops them with the joined values. A batch nested
    inside another (from a hook) gets its own, not kept (:func:`prepare`). With :class:`Scratch`, a mixed-batch forward
    allocates nothing but its outputs once a batch of its shape ran."""

    batch_size: int
    device: torch.device
    graft: tuple[int, ...] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``name``, of ``shape`` and ``dtype`` (its values: those last written). Never an inference tensor,
        even when made under ``torch.inference_mode()``: a later batch outside it writes it too."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.shape != shape or tensor.dtype != dtype:
            with torch.inference_mode(False):
                tensor = self.tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return tensor


class Scratch:
    """The intermediate results of the layers' calls on one device, shared by every graft layer of a model: they run
    one at a time, and each call's are used up before it returns. One flat tensor per name and dtype, grown to the
    largest call's size (so the largest call so far bounds it); each call takes a view of its start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` for the intermediate result ``name`` (its values: undefined). Never an
        inference tensor (see :meth:`Buffers.get`)."""
        size = math.prod(shape)
        flat = self.flat.get((name, dtype))
        if flat is None or flat.numel() < size:
            with torch.inference_mode(False):
                flat = self.flat[(name, dtype)] = torch.empty(size, dtype=dtype, device=self.device)
        return flat[:size].view(shape)


def _buffers(joined: Joined, batch_size: int, device: torch.device, kept: bool) -> Buffers:
    """``joined``'s :class:`Buffers` for a batch (new where another batch size or device held them; not kept where
    ``kept`` is false)."""
    buffers = joined.buffers
    if not kept:
        return Buffers(batch_size, device)
    if buffers is None or buffers.batch_size != batch_size or buffers.device != device:
        buffers = joined.buffers = Buffers(batch_size, device)
    return buffers


def cached_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """Every tensor the mode keeps on ``layer`` between batches beyond the grafts' values: the joined tables and the
    :class:`Buffers` (for tests and memory accounting; the model's :class:`Scratch` is kept on its tuner)."""
    joined = layer.__dict__.get(_JOINED, (None, None))[1]
    if joined is None:
        return []
    kept = [*joined.at.values(), *joined.original.values(), *joined.value.values(), *joined.tables.values()]
    kept += [then for _, then in joined.sources.values()]
    return kept + (list(joined.buffers.tensors.values()) if joined.buffers is not None else [])


def _joined(grafts: list[Values], kind: tuple) -> Joined:
    columns = {}
    for attr in dict.fromkeys(attr for graft in grafts for attr in graft):
        present = next(graft[attr] for graft in grafts if attr in graft)
        empty = tuple(t.new_empty(0) for t in present)
        columns[attr] = list(zip(*(graft.get(attr, empty) for graft in grafts), strict=True))
    return Joined(
        at={attr: torch.cat(parts[0]) for attr, parts in columns.items()},
        original={attr: torch.cat(parts[1]) for attr, parts in columns.items()},
        value={attr: torch.cat(parts[2]) for attr, parts in columns.items()},
        counts={attr: [part.numel() for part in parts[0]] for attr, parts in columns.items()},
        tables=_tables(columns, kind, len(grafts)),
        grafts=len(grafts),
    )


def _tables(columns: dict[str, list], kind: tuple, grafts: int) -> dict[str, torch.Tensor]:
    """The padded tables of :class:`Joined` (``columns``: per base tensor, the grafts' indices, base values and values).

    - linear: ``weight`` (the deltas) and ``padding`` (where a row is padding) of the weight entries by column;
      ``indices``, three tables stacked so that a batch picks them with one ``index_select``: the entries' columns (by
      column), their rows (by row) and where each slot of the rows is in column order; ``owner_bias``: the graft of
      each bias entry (to write its values into a copy of the bias per graft);
    - layer_norm: ``columns``, the features a graft changes (its entries' in each tensor in turn), padded by
      the row's first column again (elsewhere a padded slot would recompute a feature the graft leaves, which stays
      the kernel's bit for bit), ``empty``: the rows without any (the last, for none), and
      ``owner_<tensor>``: the graft of each entry, to write its values into a copy of the base per graft;
    - vector: the ``owner_<tensor>`` only.
    """
    tables = {}
    if kind[0] == "linear":
        _, in_features, _ = kind[1]
        device = next(iter(columns.values()))[0][0].device
        none = (
            [torch.empty(0, dtype=torch.int64, device=device)] * grafts,
            None,
            [torch.empty(0, device=device)] * grafts,
        )
        indices, _, deltas = columns.get("weight", none)
        rows, cols = zip(*(_rows_and_columns(at, kind[1]) for at in indices), strict=True)
        by_row = [torch.argsort(r * in_features + c, stable=True) for r, c in zip(rows, cols, strict=True)]
        tables["weight"] = _padded(deltas)
        tables["padding"] = _padding([at.numel() for at in indices] + [0], tables["weight"])
        slots = torch.arange(tables["weight"].shape[1], device=device)
        row_order = torch.where(tables["padding"], slots, _padded(by_row))  # a padded slot stays in place
        by_rows = _padded([r[order] for r, order in zip(rows, by_row, strict=True)])
        tables["indices"] = torch.stack([_padded(cols), by_rows, row_order])
    for attr, (indices, *_) in columns.items():
        if attr != "weight" or kind[0] != "linear":
            tables[f"owner_{attr}"] = torch.cat([torch.full_like(at, number) for number, at in enumerate(indices)])
    if kind[0] == "linear":
        return tables
    if kind[0] == "layer_norm":
        changed = [torch.cat([parts[0][number] for parts in columns.values()]) for number in range(grafts)]
        table = _padded(changed)
        padding = _padding([c.numel() for c in changed] + [0], table)
        tables["columns"] = torch.where(padding, table[:, :1], table)
        tables["empty"] = padding.all(1)
    return tables


def _padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (a 1-D tensor per graft) as the rows of a table, zero-padded, with a last row of zeros for none."""
    return pad_sequence([*parts, parts[0].new_zeros(0)], batch_first=True)


def _padding(lengths: list[int], table: torch.Tensor) -> torch.Tensor:
    """Where ``table``'s rows, of ``lengths`` entries each, are padding."""
    lengths = torch.tensor(lengths, device=table.device)
    return torch.arange(table.shape[1], device=table.device) >= lengths[:, None]


def _changed_layers(layers: list[tuple[nn.Module, Joined]]) -> list[bool]:
    """Per ``(layer, joined)``, whether a base value under an entry is no longer the one the values were taken against
    (they move with it: by rounding, and wholly at an entry stored exactly), or a graft's own value there is no longer
    the one they were built from. A write through ``.data`` moves no version counter, so the values are compared, bit
    for bit: a NaN under an entry equals itself, where compared as floats it differed on every batch and every batch
    built the layer's values again. One gather per base tensor, one comparison per device and dtype, and one read per
    device (on a GPU each read waits for its queue); per layer only where some differ."""
    parts: dict[tuple, tuple[list, list, list]] = {}  # (device, dtype) -> (values now, values then, layer numbers)
    for number, (layer, joined) in enumerate(layers):
        for attr, at in joined.at.items():
            then = joined.original[attr]
            now_, then_, numbers = parts.setdefault((then.device, then.dtype), ([], [], []))
            now_.append(layer.base_layer._parameters[attr].data.take(at))
            then_.append(then)
            numbers.append(number)
        for key, (live, then) in joined.sources.items():
            now_, then_, numbers = parts.setdefault(key, ([], [], []))
            now_.extend(live)
            then_.append(then)
            numbers.append(number)
    changed = [False] * len(layers)
    compared = {key: as_bits(torch.cat(now_)) != as_bits(torch.cat(then_)) for key, (now_, then_, _) in parts.items()}
    for device in {device for device, _ in compared}:  # one read per device, whatever the dtypes
        keys = [key for key in compared if key[0] == device]
        if not torch.stack([compared[key].any() for key in keys]).any().item():
            continue
        for key in keys:
            _, then_, numbers = parts[key]
            for number, part in zip(numbers, compared[key].split([t.numel() for t in then_]), strict=True):
                changed[number] = changed[number] or bool(part.any())
    return changed


@dataclass
class LayerDelta:
    """Every group's sparse delta on one linear layer, one row per example: its weight entries, by column, add
    ``x[example, ..., columns[example, k]] * weight[example, k]`` to ``out[example, ..., rows[example, j]]`` where
    ``by_row[example, j] == k`` (``rows`` is by row); its bias is ``bias[example]`` (the layer's bias with its graft's
    values written in; the layer's own where no graft changes it, None where the layer has none). Rows are padded to
    the graft with the most entries, with zeros (``padding``: where the weight part is padding, None where none is)."""

    columns: torch.Tensor
    rows: torch.Tensor
    by_row: torch.Tensor
    weight: torch.Tensor
    padding: torch.Tensor | None
    bias: torch.Tensor | None
    shape: tuple[int, int, bool]  # the layer's, as linear_shape gives it
    density: float = 0.0  # the largest share of the weight's entries one graft holds
    scratch: Scratch | None = None  # where the intermediate results go (None: new tensors)

    def forward(self, base: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``base``'s output on ``x`` with each example's graft, computed as the base layer computes its own (``addmm``
        onto the bias): the output starts as each example's bias, gets the weight deltas (:meth:`add_deltas`; while it
        is fresh in the cache: a 3,072-wide output no longer is once the product has run), then the base product over
        the whole batch."""
        out_features, in_features, transposed = self.shape
        out = x.new_empty((*x.shape[:-1], out_features))
        start = out.view(x.shape[0], math.prod(x.shape[1:-1]), out_features)
        if self.bias is None:
            start.zero_()
        else:
            start.copy_(self.bias.view(-1, 1, out_features))
        self.add_deltas(out, x)
        weight = base.weight if transposed else base.weight.t()
        out.view(-1, out_features).addmm_(x.reshape(-1, in_features), weight)
        return out

    def add_deltas(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` plus the weight deltas on ``x``: one gather from ``x`` and one ``scatter_add_`` into ``out`` along
        the features, for the whole batch whatever the number of groups (a loop over the groups would launch a few
        kernels per group and layer, most of a decoding step's time)."""
        if not self.weight.numel():
            return out
        batch_size, tokens = x.shape[0], math.prod(x.shape[1:-1])
        x3 = x.reshape(batch_size, tokens, x.shape[-1])
        out3 = out.view(batch_size, tokens, out.shape[-1])
        scratch = self.scratch or Scratch(x.device)
        shape = (batch_size, tokens, self.weight.shape[1])
        values = torch.gather(x3, 2, self.columns[:, None].expand(-1, tokens, -1), out=scratch.get("x", shape, x.dtype))
        values = _cast(values, self.weight.dtype, scratch, "products").mul_(self.weight[:, None])
        if self.padding is not None:  # x * 0 is not 0 where x is infinite
            values.masked_fill_(self.padding[:, None], 0.0)
        values = _cast(values, out.dtype, scratch, "cast")
        ordered = scratch.get("by_row", shape, out.dtype)
        torch.gather(values, 2, self.by_row[:, None].expand(-1, tokens, -1), out=ordered)
        out3.scatter_add_(2, self.rows[:, None].expand(-1, tokens, -1), ordered)
        return out


def _cast(tensor: torch.Tensor, dtype: torch.dtype, scratch: Scratch, name: str) -> torch.Tensor:
    """``tensor`` in ``dtype``: itself where it has it, else a copy into ``scratch``'s tensor ``name``."""
    if tensor.dtype == dtype:
        return tensor
    return scratch.get(name, tuple(tensor.shape), dtype).copy_(tensor)


def _layer_delta(
    layer: nn.Module,
    joined: Joined,
    graft: tuple[int, ...],
    numbers: torch.Tensor,
    shape: tuple[int, int, bool],
    buffers: Buffers | None = None,
    scratch: Scratch | None = None,
) -> LayerDelta:
    """A linear layer's :class:`LayerDelta` for a batch (``graft``: ``numbers`` on the host; ``shape``: the layer's;
    ``buffers`` and ``scratch``: where its tensors and its forward's intermediate results go, new ones if None)."""
    buffers = buffers or Buffers(len(graft), numbers.device)
    counts = joined.lengths("weight")
    width = joined.tables["weight"].shape[1]
    if buffers.graft != graft:
        for name, dim in (("indices", 1), ("weight", 0), ("padding", 0)):
            _select(joined.tables[name], dim, numbers, buffers, name)
    columns, rows, by_row = buffers.tensors["indices"].unbind(0)
    padded = any(counts[number] < width for number in graft)
    padding = buffers.tensors["padding"] if padded else None
    bias = layer.base_layer.bias
    if "bias" in joined.at:
        bias = _select(_copies(bias, joined, "bias", buffers), 0, numbers, buffers, "bias")
    density = max(counts) / (shape[0] * shape[1])
    weight = buffers.tensors["weight"]
    bias = None if bias is None else bias.data
    return LayerDelta(columns, rows, by_row, weight, padding, bias, shape, density, scratch)


def _select(table: torch.Tensor, dim: int, numbers: torch.Tensor, buffers: Buffers, name: str) -> torch.Tensor:
    """The rows of ``table`` along ``dim`` for each example (``numbers``: per example, its graft's position in the
    joined order, the number of grafts for none), into ``buffers``' tensor ``name``."""
    shape = (*table.shape[:dim], numbers.numel(), *table.shape[dim + 1 :])
    return torch.index_select(table, dim, numbers, out=buffers.get(name, shape, table.dtype))


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


def _copies(tensor: torch.Tensor, joined: Joined, attr: str, buffers: Buffers) -> torch.Tensor:
    """``(grafts + 1, features)``: a copy of the vector ``tensor`` per graft with its values written in (``attr``: its
    name; the last row: the base as it is), taken from the base on every batch, into ``buffers``."""
    copies = buffers.get(f"copies_{attr}", (joined.grafts + 1, tensor.shape[-1]), tensor.dtype)
    copies.copy_(tensor.data.expand(joined.grafts + 1, tensor.shape[-1]))
    if attr in joined.at:
        copies.index_put_((joined.tables[f"owner_{attr}"], joined.at[attr]), joined.value[attr])
    return copies


def _example_parameters(
    layer: nn.Module, joined: Joined, numbers: torch.Tensor, features: int, buffers: Buffers
) -> ExampleParameters:
    parameters = layer.base_layer._parameters
    tensors = {
        attr: _select(_copies(parameters[attr], joined, attr, buffers), 0, numbers, buffers, attr) for attr in joined.at
    }
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
    too coarse below fp32, so other inputs take the exact path. Written in place: called without autograd only
    (``mixed_batch.layer_forward``; no gradient would flow through ``mean`` and ``rstd``)."""

    columns: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    empty: torch.Tensor | None
    features: int
    scratch: Scratch | None = None  # where the intermediate results go (None: new tensors)

    def forward(self, layer: nn.Module, x: torch.Tensor, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
        base = layer.base_layer
        if x.dtype not in (torch.float32, torch.float64):
            return exact()
        out, mean, rstd = torch.native_layer_norm(x, base.normalized_shape, base.weight, base.bias, base.eps)
        batch_size = x.shape[0]
        x3, out3 = x.reshape(batch_size, -1, self.features), out.view(batch_size, -1, self.features)
        columns = self.columns[:, None].expand(-1, x3.shape[1], -1)
        scratch = self.scratch or Scratch(x.device)
        values = torch.gather(x3, 2, columns, out=scratch.get("x", tuple(columns.shape), x.dtype))
        values.sub_(mean.view(batch_size, -1, 1)).mul_(rstd.view(batch_size, -1, 1))
        weight, bias = (
            _cast(t, x.dtype, scratch, f"{name}_cast") for name, t in (("w", self.weight), ("b", self.bias))
        )
        values.mul_(weight[:, None]).add_(bias[:, None])
        if self.empty is not None:
            kept = torch.gather(out3, 2, columns, out=scratch.get("kept", tuple(columns.shape), x.dtype))
            values = torch.where(self.empty[:, None, None], kept, values, out=kept)
        return out3.scatter_(2, columns, values).view_as(out)


def _layer_norm_columns(
    layer: nn.Module,
    joined: Joined,
    graft: tuple[int, ...],
    numbers: torch.Tensor,
    buffers: Buffers | None = None,
    scratch: Scratch | None = None,
) -> LayerNormColumns:
    base = layer.base_layer
    buffers = buffers or Buffers(len(graft), numbers.device)
    columns = joined.tables["columns"]
    if buffers.graft != graft:
        _select(columns, 0, numbers, buffers, "columns")
        _select(joined.tables["empty"], 0, numbers, buffers, "empty")
    tables = {}
    for attr in ("weight", "bias"):
        tensor = getattr(base, attr)
        if tensor is None:  # no bias: zeros
            tables[attr] = buffers.get(attr, tuple(buffers.tensors["columns"].shape), tables["weight"].dtype).zero_()
            continue
        copies = _copies(tensor, joined, attr, buffers)
        picked = torch.gather(
            copies, 1, columns, out=buffers.get(f"{attr}_columns", tuple(columns.shape), copies.dtype)
        )
        tables[attr] = _select(picked, 0, numbers, buffers, attr)
    entries = joined.lengths(*joined.counts)
    empty = buffers.tensors["empty"] if any(entries[n] == 0 for n in graft) else None  # rows of padding only
    features = base.normalized_shape[0]
    return LayerNormColumns(buffers.tensors["columns"], tables["weight"], tables["bias"], empty, features, scratch)


def prepare(
    layers: list[tuple[nn.Module, list[str], list[str]]], scratch: dict[torch.device, Scratch] | None = None
) -> list[LayerDelta | LayerNormColumns | ExampleParameters | None]:
    """For each ``(layer, its grafts in the batch, the batch's graft per example)``, what the mode runs it with (None:
    the exact path), built for every layer at once, so that the base values of every layer are compared with one
    read per device, and each example's row numbers are sent to it in one copy per device, where they changed since
    the layer's last batch. Written into each layer's :class:`Buffers`, the layers' calls then using ``scratch`` (the
    model's, per device); a batch nested inside another, which must leave the outer batch's alone, passes None: its
    buffers are its own, not kept."""
    kept = scratch is not None
    found, results = [], [None] * len(layers)
    for number, (layer, holders, names) in enumerate(layers):
        kind = _kind(layer.base_layer)
        if kind is not None and kind[0] == "vector" and layer.__dict__.get(EXACT_WITH_EXAMPLE_PARAMETERS) is False:
            kind = None  # checked: not exact with per-example tensors
        joined = _joined_for(layer, holders, kind) if holders and kind is not None else None
        if joined is not None:
            position = {name: i for i, name in enumerate(holders)}
            graft = tuple(position.get(name, len(holders)) for name in names)
            found.append((number, layer, holders, kind, joined, graft))
    changed = _changed_layers([(layer, joined) for _, layer, _, _, joined, _ in found])
    ready = []
    for (number, layer, holders, kind, joined, graft), again in zip(found, changed, strict=True):
        if again:  # rare: built again against the base as it is now
            joined = _joined_for(layer, holders, kind, rebuild=True)
            if joined is None:
                continue
        ready.append((number, layer, kind, joined, graft, _buffers(joined, len(graft), joined.device, kept)))
    numbers = _on_devices({(graft, buffers.device) for *_, graft, buffers in ready if buffers.graft != graft})
    for number, layer, kind, joined, graft, buffers in ready:
        on_device = buffers.get("numbers", (len(graft),), torch.int64)
        if buffers.graft != graft:
            on_device.copy_(numbers[graft, buffers.device])
        pool = None if scratch is None else scratch.setdefault(buffers.device, Scratch(buffers.device))
        if kind[0] == "linear":
            results[number] = _layer_delta(layer, joined, graft, on_device, kind[1], buffers, pool)
        elif kind[0] == "layer_norm":
            results[number] = _layer_norm_columns(layer, joined, graft, on_device, buffers, pool)
        else:
            results[number] = _example_parameters(layer, joined, on_device, kind[1], buffers)
        buffers.graft = graft
    return results


def _on_devices(wanted: set[tuple[tuple[int, ...], torch.device]]) -> dict[tuple, torch.Tensor]:
    """Each ``(numbers, device)`` of ``wanted`` as a tensor there, sent in one copy per device."""
    out = {}
    for device in {device for _, device in wanted}:
        keys = [key for key in wanted if key[1] == device]
        sent = to_device(torch.tensor([n for numbers, _ in keys for n in numbers], dtype=torch.int64), device)
        out.update(zip(keys, sent.split([len(numbers) for numbers, _ in keys]), strict=True))
    return out


def _joined_for(layer: nn.Module, holders: list[str], kind: tuple, rebuild: bool = False) -> Joined | None:
    """The :class:`Joined` values of ``holders`` on ``layer`` (``rebuild``: each built anew), or None where the exact
    path is needed. Each graft's are kept with its in-place plan (``plan.sparse_delta``)."""
    parameters = [p for p in layer.base_layer._parameters.values() if p is not None]
    if not parameters or parameters[0].device.type == "meta":
        return None
    plans = [layer.in_place_plan((name,)) for name in holders]
    if any(plan is None for plan in plans):
        return None
    for plan in plans:
        if rebuild or plan.sparse_delta is None or plan.sparse_delta[0] != kind:
            sources = _graft_sources(plan)  # before the values: a later write then shows as a change
            values = graft_values(plan, kind, parameters[0].device)
            own = all(parameters_ is layer.base_layer._parameters for parameters_, *_ in plan.writes)
            plan.sparse_delta = (kind, (values, sources) if own and values is not None else None)
    if any(plan.sparse_delta[1] is None for plan in plans):
        return None
    values = [plan.sparse_delta[1][0] for plan in plans]
    if not any(values):
        return None
    cached = layer.__dict__.get(_JOINED, ((), None))  # the last batch's, while its grafts' values are the same objects
    if len(cached[0]) == len(values) and all(a is b for a, b in zip(cached[0], values, strict=True)):
        return cached[1]
    joined = _joined(values, kind)
    for key, live, then in _by_device_and_dtype([pair for plan in plans for pair in plan.sparse_delta[1][1]]):
        joined.sources[key] = (live, torch.cat(then))
    layer.__dict__[_JOINED] = (values, joined)
    return joined


def _graft_sources(plan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The graft's own values that its one-graft in-place ``plan`` writes (views of the graft tensors: the deltas and
    the values stored exactly), each with a copy of it now."""
    return [
        (t, t.detach().clone()) for *_, entries, _, _ in plan.writes for t in (entries[1], entries[2][1]) if t.numel()
    ]


def _by_device_and_dtype(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[tuple, list, list]]:
    """``pairs`` grouped by the device and dtype of their first tensor: ``(key, first tensors, second tensors)``."""
    groups: dict[tuple, tuple[list, list]] = {}
    for first, second in pairs:
        group = groups.setdefault((first.device, first.dtype), ([], []))
        group[0].append(first)
        group[1].append(second)
    return [(key, *group) for key, group in groups.items()]


_JOINED = "_sparse_delta_joined"
"""The attribute of a graft layer holding the last batch's joined values, with the values they were joined from: one
set per layer, reused while a batch brings the same grafts (a join is a copy of every graft's values there)."""


def forget_joined(layer: nn.Module) -> None:
    """Drop ``layer``'s joined values (when a graft's values there are dropped: they would keep them alive)."""
    layer.__dict__.pop(_JOINED, None)
