"""Where each parameter tensor of a model lives, is used, and is stored in a graft.

A tensor can be registered on several modules (tied weights: RoBERTa's MLM decoder and word embeddings, a causal LM's
output head and input embeddings). A graft stores each tensor's entries once, on its *storage module*, and applies
them on every *application module*: the leaf modules that register it (their forward is where it is used), or the
registering module itself when no leaf does. Everything here derives from the model structure alone, so saving and
loading agree without storing any of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

logger = logging.getLogger(__name__)


NO_ENTRIES = (torch.empty(0, dtype=torch.int64), torch.empty(0))
"""No entries of a flat index space, as ``(int64 indices, fp32 values)``; never written to."""


class FlatIndexSpace:
    """The flat index space of a storage module: its stored tensors flattened and concatenated, in order.

    A graft addresses an entry of a module by one integer in this space; :meth:`split` turns sorted flat indices back
    into ``(tensor attribute, local flat indices, positions)``.
    """

    def __init__(self, attrs: Sequence[str], sizes: Sequence[int]) -> None:
        self.attrs = list(attrs)
        self.offsets = torch.tensor([0, *torch.tensor(list(sizes), dtype=torch.int64).cumsum(0).tolist()])

    @property
    def size(self) -> int:
        """Number of entries in the space."""
        return int(self.offsets[-1])

    def start(self, attr: str) -> int:
        """Flat index of the first entry of tensor ``attr``."""
        return int(self.offsets[self.attrs.index(attr)])

    def index_dtype(self) -> torch.dtype:
        """The smallest integer dtype that holds every index of the space (int32 unless it is huge)."""
        return torch.int64 if self.size > torch.iinfo(torch.int32).max else torch.int32

    def split(self, indices: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, slice]]:
        """Yield ``(attr, local int64 indices, positions in indices)`` per tensor holding some of sorted ``indices``."""
        bounds = torch.searchsorted(indices.to(torch.int64).cpu(), self.offsets).tolist()
        for i, attr in enumerate(self.attrs):
            if bounds[i + 1] > bounds[i]:
                position = slice(bounds[i], bounds[i + 1])
                yield attr, indices[position].to(torch.int64) - int(self.offsets[i]), position


@dataclass(frozen=True)
class TensorInfo:
    """One unique parameter tensor."""

    name: str  # canonical name: the first registration, as in ``model.named_parameters()``
    module: str  # storage module
    attr: str  # attribute name on the storage module
    aliases: tuple[str, ...]  # every registered name, canonical first
    parameter: nn.Parameter


@dataclass
class Layout:
    """Structure of a model as seen by grafts."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # canonical name -> info
    stored: dict[str, list[str]] = field(default_factory=dict)  # storage module -> attrs stored there, in order
    tied: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)  # module -> attr -> (module, attr)
    unsupported: list[str] = field(default_factory=list)  # tensors used directly by a non-leaf module
    by_site: dict[tuple[str, str], TensorInfo] = field(default_factory=dict)  # (storage module, attr) -> info

    def index_space(self, module: str) -> FlatIndexSpace:
        """The flat index space of storage module ``module``."""
        attrs = self.stored[module]
        return FlatIndexSpace(attrs, [self.by_site[(module, attr)].parameter.numel() for attr in attrs])

    def application_modules(self, storage_modules: set[str]) -> set[str]:
        """Every module that must be wrapped to apply grafts stored on ``storage_modules``."""
        modules = set(storage_modules)
        for user, attrs in self.tied.items():
            if any(src_module in storage_modules for src_module, _ in attrs.values()):
                modules.add(user)
        return modules


PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the base model


def peft_free_name(name: str) -> str:
    """``name`` without peft's wrapping levels (``base_layer``, ``original_module``, ``modules_to_save.<adapter>``):
    the name the plain model gives the tensor or module."""
    parts, out, skip = name.split("."), [], False
    for part in parts:
        if skip:
            skip = False
        elif part == "modules_to_save":
            skip = True
        elif part not in ("base_layer", "original_module"):
            out.append(part)
    return ".".join(out)


def _normalize(name: str) -> str:
    """Module name without peft's ``.base_layer`` wrapping levels."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


def build_layout(model: nn.Module) -> Layout:
    """Analyse ``model`` (plain or already carrying graft layers) into a :class:`Layout`."""
    skip_prefixes: list[str] = []
    registrations: dict[int, list[tuple[str, str, bool, nn.Parameter]]] = {}
    for name, module in model.named_modules():
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        if isinstance(module, AuxiliaryTrainingWrapper):
            skip_prefixes.append(name + ".")  # modules_to_save: stored whole, never grafted
            continue
        if isinstance(module, BaseTunerLayer):
            # Only the wrapped base layer holds model parameters; skip the adapter containers.
            skip_prefixes.extend(f"{name}.{child}" for child, _ in module.named_children() if child != "base_layer")
            continue
        is_leaf = next(module.children(), None) is None
        if isinstance(module, nn.MultiheadAttention):
            # Its forward reads out_proj's weight and bias directly (F.multi_head_attention_forward), never through
            # out_proj's own forward: a graft wrapped around out_proj would be ignored unless merged.
            direct = f"{name}.out_proj" if name else "out_proj"
            skip_prefixes.append(direct)  # registered here as used by a non-leaf module: not graftable
            for attr, param in module.out_proj._parameters.items():
                if param is not None:
                    registrations.setdefault(id(param), []).append((_normalize(direct), attr, False, param))
        for attr, param in module._parameters.items():
            if param is not None:
                registrations.setdefault(id(param), []).append((_normalize(name), attr, is_leaf, param))

    layout = Layout()
    for regs in registrations.values():
        aliases = tuple(f"{m}.{a}" if m else a for m, a, _, _ in regs)
        sites = [(m, a) for m, a, leaf, _ in regs if leaf]
        if not sites:
            # Used directly in a parent's forward: wrapping a parent would hide its children from peft's injection.
            layout.unsupported.append(aliases[0])
            continue
        (module, attr), param = sites[0], regs[0][3]
        info = TensorInfo(aliases[0], module, attr, aliases, param)
        layout.tensors[info.name] = layout.by_site[(module, attr)] = info
        layout.stored.setdefault(module, []).append(attr)
        for user_module, user_attr in sites[1:]:
            layout.tied.setdefault(user_module, {})[user_attr] = (module, attr)
    if layout.unsupported:
        logger.warning(
            "These parameters are used directly by non-leaf modules and cannot be grafted: %s", layout.unsupported
        )
    return layout


def num_base_parameters(model: nn.Module) -> int:
    """All parameters of the plain model under peft's wrappers, each tensor once (tied tensors once): a wrapped layer
    counts its base layer, a ``modules_to_save`` head its original module, never an adapter's own tensors (graft
    values, scores S, head copies). The denominator of a graft's ``fraction_of_parameters``; a parameter DeepSpeed
    ZeRO-3 partitions counts its whole size (``ds_numel``)."""
    skip: set[str] = set()  # "name." of the modules whose parameters are an adapter's
    seen: set[int] = set()
    total = 0
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        parts = prefix.split(".")[:-1]
        if any(".".join(parts[:end]) + "." in skip for end in range(1, len(parts) + 1)):  # in a skipped module
            continue
        if isinstance(module, (AuxiliaryTrainingWrapper, BaseTunerLayer)):
            keep = "original_module" if isinstance(module, AuxiliaryTrainingWrapper) else "base_layer"
            skip.update(f"{prefix}{child}." for child, _ in module.named_children() if child != keep)
        for param in module._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                total += getattr(param, "ds_numel", None) or param.numel()  # ZeRO-3: not the placeholder
    return total


def exact_positions(
    indices: torch.Tensor, unreachable: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in sorted ``indices`` of the ``unreachable`` entries among them, and their theta_ft."""
    wanted, targets = unreachable
    if not wanted.numel() or not indices.numel():
        return NO_ENTRIES
    indices = indices.to(torch.int64)
    wanted = wanted.to(indices.device, torch.int64)
    at = torch.searchsorted(indices, wanted).clamp_max(indices.numel() - 1)
    hit = indices[at] == wanted
    return at[hit], targets.to(indices.device)[hit]
