"""The value type of the library: a :class:`Region` is a set of parameter entries, with set algebra.

A region maps a parameter name (as in ``model.named_parameters()``) to the sorted unique flat indices of its entries.
Regions are what strategies choose, what ``MaskTrainer`` learns, what a saved graft holds and what continual learning
keeps apart.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import torch
from safetensors.torch import load_file
from torch import nn

from .._checksum import CONFIG_NAME, WEIGHTS_NAME, check_integrity_fields, verify_weights_checksum
from .._files import check_file, read_json
from ..parameter_layout import PEFT_PREFIX, Layout, build_layout


class Region(Mapping[str, torch.Tensor]):
    """An immutable set of entries: parameter name -> sorted unique flat indices (int64).

    A mapping over the tensors that hold entries: ``len(region)``, iteration and ``region[name]`` are per *tensor*
    (``len(region) == region.num_tensors``). The number of *entries* (the graft's size) is :attr:`num_entries`.
    """

    def __init__(self, indices: Mapping[str, torch.Tensor] | None = None):
        self._indices: dict[str, torch.Tensor] = {}
        for name, idx in (indices or {}).items():
            idx = torch.as_tensor(idx).reshape(-1)
            if idx.numel() and (idx.is_floating_point() or idx.dtype == torch.bool):
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

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, model: nn.Module) -> Region:
        """The region of a graft saved with ``save_pretrained`` in folder ``path``, by parameter name of ``model``.

        ``model`` is the pre-trained model the graft was made for (plain or wrapped by peft): only its structure is
        read, to turn each module's flat indices into parameter names. Reads the JSON config and the safetensors
        weights only (never a pickle).
        """
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return saved_region(path, build_layout(base))

    def to_masks(self, shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
        """Dense boolean masks of the given shapes (one per name in ``shapes``)."""
        masks = {}
        for name, shape in shapes.items():
            mask = torch.zeros(shape, dtype=torch.bool)
            if name in self._indices:
                last = int(self._indices[name][-1])
                if last >= mask.numel():
                    raise ValueError(
                        f"Region entries of {name!r} reach flat index {last}, outside its shape {tuple(mask.shape)} "
                        f"({mask.numel()} entries)."
                    )
                mask.view(-1)[self._indices[name]] = True
            masks[name] = mask
        return masks

    # Mapping protocol
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._indices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._indices)

    def __len__(self) -> int:
        """The number of tensors holding entries (not of entries: see :attr:`num_entries`)."""
        return len(self._indices)

    @property
    def num_tensors(self) -> int:
        """Number of tensors holding entries (``len(region)``)."""
        return len(self._indices)

    @property
    def num_entries(self) -> int:
        """Number of entries in the region, over all its tensors (a graft's size)."""
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

    # Algebra (with a Region, or a mapping of indices Region() accepts)
    def __or__(self, other: Region) -> Region:
        other = _as_region(other)
        names = self._indices.keys() | other._indices.keys()
        empty = torch.empty(0, dtype=torch.int64)
        return Region({n: torch.cat([self._indices.get(n, empty), other._indices.get(n, empty)]) for n in names})

    def __and__(self, other: Region) -> Region:
        other = _as_region(other)
        return Region(
            {n: idx[torch.isin(idx, other._indices[n])] for n, idx in self._indices.items() if n in other._indices}
        )

    def __sub__(self, other: Region) -> Region:
        other = _as_region(other)
        return Region(
            {n: idx[~torch.isin(idx, other._indices[n])] if n in other else idx for n, idx in self._indices.items()}
        )

    union, intersection, difference = __or__, __and__, __sub__

    def overlap(self, other: Region) -> float:
        """The paper's asymmetric overlap ``|self & other| / |other|`` (Figure 8a)."""
        other = _as_region(other)
        return (self & other).num_entries / other.num_entries if other.num_entries else 0.0

    def iou(self, other: Region) -> float:
        """Intersection over union ``|self & other| / |self | other|``."""
        other = _as_region(other)
        union = (self | other).num_entries
        return (self & other).num_entries / union if union else 0.0


def _as_region(other: object) -> Region:
    if isinstance(other, Region):
        return other
    if isinstance(other, Mapping):
        return Region(other)
    raise TypeError(f"Region algebra needs a Region (or a mapping of name -> indices), got {type(other).__name__}.")


def saved_region(path: str | os.PathLike, layout: Layout) -> Region:
    """The region of the graft saved in folder ``path``, for the model whose structure is ``layout``."""
    path = os.fspath(path)
    config_file, weights_file = os.path.join(path, CONFIG_NAME), os.path.join(path, WEIGHTS_NAME)
    for file, what in ((config_file, "adapter config"), (weights_file, "adapter weights file")):
        if not check_file(file, what, missing_ok=True):
            raise ValueError(f"{path!r} is not a saved graft: {os.path.basename(file)} is missing.")
    try:
        config = read_json(config_file, "adapter config")
    except ValueError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}): save the graft again.") from error
    grafted_modules = config.get("grafted_modules") if isinstance(config, dict) else None
    if not isinstance(grafted_modules, dict):
        raise ValueError(f"{config_file} records no grafted_modules: it is not a graft adapter config.")
    check_integrity_fields(path)
    verify_weights_checksum(path)
    weights = load_file(check_file(weights_file, "adapter weights file"))
    region = {}
    for module, count in grafted_modules.items():
        indices = weights.get(f"{PEFT_PREFIX}{module}.graft_indices")
        if module not in layout.stored or indices is None or indices.numel() != count:
            raise ValueError(
                f"The graft in {path!r} does not fit this model: module {module!r} holds no parameter of it, or "
                "its entries are missing from the weights."
            )
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ValueError(
                f"The graft in {path!r} stores the indices of module {module!r} as {indices.dtype}, not integers: "
                "the file is corrupt or not written by peft_graft."
            )
        indices = indices.to(torch.int64)
        space = layout.index_space(module)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= space.size):
            raise ValueError(
                f"The graft in {path!r} indexes module {module!r} outside [0, {space.size}): the file is corrupt "
                "or made for another model."
            )
        for attr, local, _ in space.split(torch.sort(indices).values):
            region[layout.by_site[(module, attr)].name] = local
    return Region(region)
