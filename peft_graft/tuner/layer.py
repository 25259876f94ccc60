"""The graft adapter layer: applies ``gamma * (theta_ft - theta_pre)`` to the parameters of any module."""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
import threading
import warnings
from typing import Any

import torch
from peft.tuners._buffer_dict import BufferDict
from peft.tuners.tuners_utils import BaseTunerLayer, _get_in_out_features, check_adapters_to_merge
from peft.utils.other import ModulesToSaveWrapper, _set_layer_requires_grad
from torch import nn
from torch.nn import functional as F

from ..parameter_layout import NO_ENTRIES, FlatIndexSpace, exact_positions
from ..sharding import is_partitioned, is_sharded, read_entries
from .autograd import RecomputeSoftParameters, SoftBackward
from .entries import SparseEntries, check_entries, entries_of, graft_entries
from .in_place import (
    FORWARDS,
    WRITE_LOCK,
    InPlacePlan,
    InPlaceWrite,
    suspended_writes,
    tensor_dict,
)
from .learning import RegionLearner
from .mixed_batch import MixedBatch, layer_forward
from .packed import PackedStore
from .sparse_delta import forget_joined

# Module switches, for tests and benchmarks of autograd.GraftedRows, autograd.SparseLinearDelta and the in-place
# inference forward (GraftLayer.in_place_plan).
GRAFT_EMBEDDING_ROWS = True
GRAFT_SPARSE_LINEAR = True
GRAFT_IN_PLACE_INFERENCE = True

# peft's _get_in_out_features warns about any module without in/out features (norms, custom layers): it is written for
# methods that need them (LoRA's matrices). A graft applies entries to any parameter tensor, so for graft layers only
# that warning says nothing the user can act on.
UNSUPPORTED_LAYER_WARNING = r"Unsupported layer type '.*' encountered, proceed at your own risk\."

GRAFT_TENSORS = ("graft_indices", "graft_values", "graft_exact_positions", "graft_exact_values")
"""The containers of a hard region's tensors on a graft layer, by attribute name (and state-dict key part)."""


def in_out_features(base_layer: nn.Module) -> tuple[int | None, int | None]:
    """peft's ``_get_in_out_features`` of ``base_layer`` (``(None, None)`` if unknown), without its warning about
    layer types it does not know: a graft supports every parameter tensor. The filter holds for this call only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=UNSUPPORTED_LAYER_WARNING, category=UserWarning)
        return _get_in_out_features(base_layer)


class GraftLayer(nn.Module, BaseTunerLayer):
    """Wraps one module and grafts sparse entries onto its parameters.

    The layer *stores* the entries of the tensors in ``stored_attrs`` (a :class:`FlatIndexSpace`: those tensors
    flattened and concatenated in order) and *applies* them together with the entries of tied tensors stored on other
    layers (``tied_sources``), so a tensor shared by several modules is stored once and used consistently everywhere.

    Per adapter it holds either a hard region (``graft_indices``, sorted, and fp32 ``graft_values`` = theta_ft -
    theta_pre there), or, while :class:`~peft_graft.MaskTrainer` learns the region, a :class:`RegionLearner`
    (``graft_learning``) with the scores S of paper Eq. 4. Only the hard region is ever saved.

    Exactness: each value is the fp32 delta ``d`` with ``(theta_pre.float() + d).to(dtype) == theta_ft``. Where no
    fp32 delta gives theta_ft (entries fine-tuning shrank towards 0), ``graft_exact_positions`` (positions among the
    adapter's entries) and ``graft_exact_values`` (theta_ft there, fp32) hold it, and applying or merging the adapter
    writes theta_ft itself there: 8 bytes per entry, 16 for those few.

    Scale: ``scaling[adapter]`` (1.0 when absent) is a run-time factor ``a`` on a hard region, as LoRA's
    ``set_scale``: the layer applies ``theta_pre + a * (theta_ft - theta_pre)`` at its entries (``a = 1``: theta_ft
    bit for bit, by the same code path as without a scale). Never saved: a loaded graft has scale 1.
    """

    adapter_layer_names = ("graft_values", "graft_learning")
    other_param_names = ("graft_indices", "graft_exact_positions", "graft_exact_values")

    def __init__(
        self,
        base_layer: nn.Module,
        stored_attrs: list[str],
        tied_sources: dict[str, tuple[GraftLayer, str]],
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.graft_values = nn.ParameterDict()
        self.graft_indices = BufferDict(persistent=True)
        self.graft_exact_positions = BufferDict(persistent=True)
        self.graft_exact_values = BufferDict(persistent=True)
        self.graft_learning = nn.ModuleDict()
        self.packed: dict[str, PackedStore] = {}  # frozen adapters held in a flat store (packed.py), at row pack_row
        self.pack_row: int | None = None  # this layer's row in every store, set when it first packs an adapter
        self.space = FlatIndexSpace(stored_attrs, [getattr(base_layer, attr).numel() for attr in stored_attrs])
        self.tied_sources = dict(tied_sources)  # plain dict: the source layers are not submodules of this one
        self.fingerprints: dict[str, list[float]] = {}  # theta_pre at the first two grafted entries, per adapter
        self.checksums: dict[str, str] = {}  # of theta_pre at every grafted entry, per adapter
        self.verify_base: dict[str, bool] = {}
        self.awaiting_entries: set[str] = set()  # adapters created empty by update_layer, not yet checked once filled
        self._merge_backup: dict[str, list[torch.Tensor]] = {}
        self._entries_cache: dict[tuple[str, str], tuple] = {}  # see _sparse_entries
        self._in_place_plans: dict[tuple[str, ...], InPlacePlan] = {}  # by active adapters; see in_place_plan
        self.written_plan: InPlacePlan | None = None  # the plan in_place.written_in_place wrote for the model's forward
        self.mixed_batch: MixedBatch | None = None  # one graft per example, while a mixed batch runs (mixed_batch.py)
        self.scaling: dict[str, float] = {}  # run-time scale per adapter, 1.0 when absent (see set_scale)
        # Dense soft parameters rebuilt in backward (autograd.RecomputeSoftParameters) instead of kept by the layer's
        # ops: MaskTrainingArguments.recompute_soft_parameters sets it
        self.recompute_soft_parameters = False
        self._disable_adapters = False
        self.merged_adapters = []
        self.in_features, self.out_features = in_out_features(base_layer)  # as peft's layers; None if unknown
        self._register_state_dict_hook(_packed_state_dict)
        self._register_load_state_dict_pre_hook(_unpack_loaded, with_module=True)

    # ----------------------------------------------------------------------------------------------- state
    @property
    def stored_attrs(self) -> list[str]:
        """Names of the tensors whose entries this layer stores, in flat-index order."""
        return self.space.attrs

    @property
    def num_stored(self) -> int:
        """Size of this layer's flat index space."""
        return self.space.size

    def has_region(self, adapter_name: str) -> bool:
        """Whether this layer holds a hard region of ``adapter_name`` (in its own tensors or packed)."""
        return adapter_name in self.graft_values or adapter_name in self.packed

    def attach_packed(self, adapter_name: str, store: PackedStore) -> None:
        """Read the entries of ``adapter_name`` (and its records of theta_pre) from row ``pack_row`` of ``store`` from
        now on, dropping the layer's own (:func:`~peft_graft.tuner.packed.pack_adapter` made the store from them)."""
        for name in GRAFT_TENSORS:
            container = getattr(self, name)
            if adapter_name in container:
                del container[adapter_name]
        for record in (self.fingerprints, self.checksums, self.verify_base):
            record.pop(adapter_name, None)
        self.packed[adapter_name] = store
        self.awaiting_entries.discard(adapter_name)  # pack_adapter packs loaded entries only

    def unpack(self, adapter_name: str) -> None:
        """Give ``adapter_name`` its own tensors on this layer again (frozen values, copies of the store's), on the base
        layer's device; the store is freed once no layer reads it. Nothing when it is not packed here."""
        store = self.packed.get(adapter_name)
        if store is None:
            return
        with torch.inference_mode(False):  # tensors with version counters, even when unpacked inside inference_mode
            indices, values = store.entries(self.pack_row)
            exact = store.exact_entries(self.pack_row)
            self.graft_indices[adapter_name] = indices.clone()
            self.graft_values[adapter_name] = nn.Parameter(values.clone(), requires_grad=False)
            if exact is not None:
                self.graft_exact_positions[adapter_name] = exact[0].clone()
                self.graft_exact_values[adapter_name] = exact[1].clone()
        fingerprint, checksum, verify_base = self.base_records(adapter_name)
        if fingerprint is not None:
            self.fingerprints[adapter_name] = fingerprint
        if checksum is not None:
            self.checksums[adapter_name] = checksum
        if verify_base is not None:
            self.verify_base[adapter_name] = verify_base
        del self.packed[adapter_name]
        self._forget(adapter_name)  # cached entries and plans would keep the store alive
        self._move_adapter_to_device_of_base_layer(adapter_name)

    def _forget(self, adapter_name: str) -> None:
        """Drop the cached entries, in-place plans and joined sparse deltas built from ``adapter_name``'s tensors."""
        self._entries_cache = {key: item for key, item in self._entries_cache.items() if key[0] != adapter_name}
        self._in_place_plans = {key: plan for key, plan in self._in_place_plans.items() if adapter_name not in key}
        forget_joined(self)

    def base_records(self, adapter_name: str) -> tuple[list[float] | None, str | None, bool | None]:
        """``(fingerprint, checksum, verify_base)`` recorded of theta_pre for ``adapter_name`` (``None`` if absent)."""
        store = self.packed.get(adapter_name)
        if store is None:
            return (
                self.fingerprints.get(adapter_name),
                self.checksums.get(adapter_name),
                self.verify_base.get(adapter_name),
            )
        row = self.pack_row
        verify_base = store.verify_base[row]
        return store.fingerprints[row], store.checksums[row], None if verify_base == 2 else bool(verify_base)

    def _all_available_adapter_names(self) -> list[str]:
        return sorted(set(super()._all_available_adapter_names()) | set(self.packed))

    def update_layer(
        self,
        adapter_name: str,
        num_entries: int,
        fingerprint: list[float],
        verify_base: bool,
        checksum: str | None = None,
        num_exact: int = 0,
    ) -> None:
        """Create an empty hard region of ``num_entries`` entries (``num_exact`` of them stored as theta_ft), to be
        filled by loading or :meth:`set_region`."""
        device = self._device()
        index_dtype = self.space.index_dtype()
        # -1: no entry yet. Loading overwrites every index; one left negative means the weights were never loaded.
        self.graft_indices[adapter_name] = torch.full((num_entries,), -1, dtype=index_dtype, device=device)
        self.graft_values[adapter_name] = nn.Parameter(torch.zeros(num_entries, device=device))
        if num_exact:
            self.graft_exact_positions[adapter_name] = torch.zeros(num_exact, dtype=index_dtype, device=device)
            self.graft_exact_values[adapter_name] = torch.zeros(num_exact, device=device)
        # The config's list itself (never mutated): a loaded graft keeps one copy per module, not two.
        self.fingerprints[adapter_name] = fingerprint if isinstance(fingerprint, list) else list(fingerprint)
        if checksum:
            self.checksums[adapter_name] = checksum
        self.verify_base[adapter_name] = verify_base
        self.awaiting_entries.add(adapter_name)

    def set_region(
        self,
        adapter_name: str,
        indices: torch.Tensor,
        values: torch.Tensor,
        unreachable: tuple[torch.Tensor, torch.Tensor] = NO_ENTRIES,
    ) -> None:
        """Set the hard region: sorted flat ``indices`` into this layer's space and fp32 ``values`` there.

        ``unreachable``: sorted flat indices and theta_ft (fp32) where no fp32 delta reproduces theta_ft; those among
        ``indices`` are stored exactly (see the class docstring), the others are ignored.
        """
        check_entries(indices, values, self.num_stored, f"The region of adapter {adapter_name!r}")
        self.unpack(adapter_name)
        device = self._device()
        requires_grad = adapter_name in self.graft_values and self.graft_values[adapter_name].requires_grad
        self.graft_indices[adapter_name] = indices.to(device, self.space.index_dtype())
        self.graft_values[adapter_name] = nn.Parameter(values.to(device, torch.float32), requires_grad=requires_grad)
        positions, targets = exact_positions(indices, unreachable)
        for container in (self.graft_exact_positions, self.graft_exact_values):
            if adapter_name in container:
                del container[adapter_name]
        if positions.numel():
            self.graft_exact_positions[adapter_name] = positions.to(device, self.space.index_dtype())
            self.graft_exact_values[adapter_name] = targets.to(device, torch.float32)
        self.fingerprints[adapter_name] = self.base_values(indices[:2]).tolist()
        self.checksums[adapter_name] = self.base_checksum(indices)
        self.verify_base.setdefault(adapter_name, True)
        self.awaiting_entries.discard(adapter_name)

    def set_scale(self, adapter_name: str, scale: float) -> None:
        """Apply the hard region of ``adapter_name`` at ``scale``: ``theta_pre + scale * (theta_ft - theta_pre)``.

        Any finite real is allowed (``scale > 1`` extrapolates, ``< 0`` negates, as in task arithmetic). Refused while
        the adapter is merged here (unmerge first) or learning its region. An adapter this layer does not hold is
        ignored, as LoRA does.
        """
        scale = check_scale(scale)
        if adapter_name in self.merged_adapters:
            raise ValueError(
                f"Cannot set the scale of adapter {adapter_name!r} while it is merged: unmerge first "
                "(model.unmerge_adapter()), set the scale, then merge again if needed."
            )
        if self.is_learning(adapter_name):
            raise ValueError(
                f"Cannot set the scale of adapter {adapter_name!r}: it is learning its region, and a scale applies to "
                "hard regions only. Harden it first (harden_region())."
            )
        if not self.has_region(adapter_name):
            return
        if scale == 1.0:
            self.scaling.pop(adapter_name, None)
        else:
            self.scaling[adapter_name] = scale

    def check_scale_fits(self, adapter_name: str, scale: float) -> None:
        """Refuse a ``scale`` at which the grafted values of ``adapter_name`` overflow the base tensors' dtype (a
        finite scale times a delta can exceed even fp32's range): the outputs would be inf or NaN."""
        if not self.has_region(adapter_name) or self.is_learning(adapter_name):
            return
        for attr in self.stored_attrs:
            entries = self._sparse_entries(adapter_name, attr)
            if entries is None or not entries[0].numel():
                continue
            tensor = getattr(self.base_layer, attr)
            with torch.no_grad():
                grafted = graft_entries(tensor.detach().reshape(-1)[entries[0]], entries, True, scale)
            if not bool(torch.isfinite(grafted).all()):
                raise ValueError(
                    f"scale={scale!r} makes adapter {adapter_name!r}'s grafted values of tensor {attr!r} of "
                    f"{type(self.base_layer).__name__} overflow {tensor.dtype} (inf or NaN): use a smaller scale."
                )

    def check_cast_fits(self, fn: Any, where: str = "") -> None:
        """Refuse ``fn`` (of ``nn.Module._apply``, e.g. ``.half()``) when it casts a tensor this layer grafts to a dtype
        whose range a grafted value exceeds (beyond fp16's 65,504): the cast model's outputs would be inf or NaN. A
        ``ValueError`` naming the adapter, the tensor (``where``: the layer's module name) and the value."""
        for attr in self.stored_attrs:
            tensor = getattr(self.base_layer, attr)
            if tensor.device.type == "meta" or not _casts_dtype(fn, [tensor]):  # meta: no values to cast
                continue
            for adapter_name in self._all_available_adapter_names():
                indices = self.graft_indices[adapter_name] if adapter_name in self.graft_indices else None  # noqa: SIM401 (BufferDict has no get)
                unloaded = indices is not None and indices.numel() and int(indices.min()) < 0  # see update_layer
                if not self.has_region(adapter_name) or self.is_learning(adapter_name) or unloaded:
                    continue
                entries = self._sparse_entries(adapter_name, attr)
                if entries is None or not entries[0].numel():
                    continue
                with torch.no_grad():
                    current = tensor.detach().reshape(-1)[entries[0].to(tensor.device)]
                    if adapter_name not in self.merged_adapters:  # merged: the base tensor holds the grafted values
                        current = graft_entries(current, entries, True, self.get_scale(adapter_name))
                    cast = fn(current)
                overflow = torch.isfinite(current) & ~torch.isfinite(cast.to(current.device))
                if bool(overflow.any()):
                    value = float(current[overflow][0])
                    limit = torch.finfo(cast.dtype).max
                    raise ValueError(
                        f"Casting to {cast.dtype} would turn the grafted value {value:.6g} of adapter {adapter_name!r} "
                        f"in tensor {where}{attr} into inf ({cast.dtype} holds up to {limit:.6g}): "
                        "the outputs would be inf or NaN. Nothing was cast. Keep the model in float32, cast to "
                        "torch.bfloat16 (float32's range), or delete that adapter first."
                    )

    def get_scale(self, adapter_name: str) -> float:
        """The run-time scale of ``adapter_name`` (1.0 unless :meth:`set_scale` changed it)."""
        return self.scaling.get(adapter_name, 1.0)

    def start_learning(self, adapter_name: str, learner: RegionLearner) -> None:
        """Attach the state to learn this adapter's region here, on the base layer's device."""
        self.scaling.pop(adapter_name, None)  # a scale applies to hard regions only
        self.unpack(adapter_name)
        self.graft_learning[adapter_name] = learner.to(self._device())  # the movement follows S on first use
        if adapter_name in self.graft_values:  # not used while the region is learned: S is what trains
            self.graft_values[adapter_name].requires_grad_(False)

    def set_adapter(self, adapter_names: str | list[str], inference_mode: bool = False) -> None:
        """peft's ``set_adapter``; the hard values of an adapter learning its region stay frozen (unused then). A packed
        adapter activated without ``inference_mode`` is unpacked first: peft makes its values trainable."""
        names = [adapter_names] if isinstance(adapter_names, str) else adapter_names
        if not inference_mode and self.packed:
            for adapter_name in names:
                self.unpack(adapter_name)
        # peft's loop (requires_grad = active and not inference_mode, leaves only), run over the containers' dicts and
        # writing only flags that change: switching among many loaded grafts costs a check per tensor (issue 38).
        modules = self._modules
        learners = modules["graft_learning"]._modules
        for adapter_name, values in modules["graft_values"]._parameters.items():
            trainable = not inference_mode and adapter_name in names and adapter_name not in learners
            if values.requires_grad != trainable and values.is_leaf:
                values.requires_grad_(trainable)
        for adapter_name, learner in learners.items():
            _set_layer_requires_grad(learner, not inference_mode and adapter_name in names)
        self._freeze_non_trainable_peft_weights(names)
        object.__setattr__(self, "_active_adapter", names)  # a plain attribute: no need of nn.Module's checks

    def set_requires_grad(self, adapter_names: str | list[str], requires_grad: bool = True) -> None:
        """peft's ``set_requires_grad``; packed adapters made trainable are unpacked first."""
        if requires_grad:
            for adapter_name in [adapter_names] if isinstance(adapter_names, str) else adapter_names:
                self.unpack(adapter_name)
        super().set_requires_grad(adapter_names, requires_grad)

    def stop_learning(self, adapter_name: str) -> None:
        """Release the learning state of ``adapter_name`` (its hard region stays)."""
        if adapter_name in self.graft_learning:
            del self.graft_learning[adapter_name]

    def empty_start(self, adapter_name: str) -> torch.Tensor | None:
        """The stored hard region's values of ``adapter_name`` while it learns its region here and that region holds
        no entry (an empty gamma_base on this layer), else ``None``: what :meth:`drop_empty_start` drops."""
        values = self.graft_values.get(adapter_name)
        return values if self.is_learning(adapter_name) and values is not None and not values.numel() else None

    def drop_empty_start(self, adapter_name: str) -> None:
        """While ``adapter_name`` learns its region here, drop its stored hard region when that holds no entry (an
        empty gamma_base on this layer): unused while S trains, set anew when the region is hardened, and an empty
        parameter, which DeepSpeed ZeRO-3 cannot gather."""
        if self.empty_start(adapter_name) is None:
            return
        for container in (self.graft_values, self.graft_indices, self.graft_exact_positions, self.graft_exact_values):
            if adapter_name in container:
                del container[adapter_name]
        self._forget(adapter_name)

    def learner(self, adapter_name: str) -> RegionLearner | None:
        """The learning state of ``adapter_name``, or ``None`` when its region is hard."""
        return self.graft_learning[adapter_name] if adapter_name in self.graft_learning else None  # noqa: SIM401

    def is_learning(self, adapter_name: str) -> bool:
        """Whether the region of ``adapter_name`` is being learned on this layer."""
        return adapter_name in self.graft_learning

    def entries(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat indices, fp32 values)`` of the hard region of ``adapter_name``; while learning, the hard region the
        layer applies (``RegionLearner.hard``), else ``round(gamma)``."""
        learner = self.learner(adapter_name)
        if learner is not None:
            return learner.hard if learner.hard is not None else learner.harden()
        if adapter_name in self.graft_indices:
            return self.graft_indices[adapter_name], self.graft_values[adapter_name]
        store = self.packed.get(adapter_name)
        if store is not None:
            return store.entries(self.pack_row)
        return NO_ENTRIES

    def holding(self, adapter_names: list[str]) -> set[str]:
        """Those of ``adapter_names`` with at least one entry in :meth:`entries`, found without calling it for a stored
        region (a mixed batch asks every layer for every graft)."""
        learning, indices = self.graft_learning, self.graft_indices
        return {
            name
            for name in adapter_names
            if (indices[name].numel() if name in indices and name not in learning else self.entries(name)[0].numel())
        }

    def exact_entries(
        self, adapter_name: str, indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions among entries(adapter_name), theta_ft as fp32)`` of the entries stored exactly; ``indices``:
        those entries' flat indices when already at hand (spares a learning layer rounding its region again)."""
        learner = self.learner(adapter_name)
        if learner is not None:
            return learner.exact_at(self.entries(adapter_name)[0] if indices is None else indices)
        if adapter_name in self.graft_exact_positions:
            return self.graft_exact_positions[adapter_name], self.graft_exact_values[adapter_name]
        store = self.packed.get(adapter_name)
        if store is not None:
            return store.exact_entries(self.pack_row) or NO_ENTRIES
        return NO_ENTRIES

    def region_by_tensor(self, adapter_name: str) -> dict[str, torch.Tensor]:
        """The hard region of ``adapter_name`` as local flat indices per stored tensor attribute."""
        indices, _ = self.entries(adapter_name)
        return {attr: local for attr, local, _ in self.space.split(indices)}

    def soft_parameters(self, adapter_name: str, mode: SoftBackward = "keep") -> dict[str, torch.Tensor]:
        """The learning adapter's grafted tensors, differentiable in S (see :meth:`RegionLearner.soft_parameters`)."""
        return self.graft_learning[adapter_name].soft_parameters(self.base_layer, mode)

    def base_values(self, indices: torch.Tensor) -> torch.Tensor:
        """Current values of the stored tensors at flat ``indices`` (as fp32); a collective when FSDP2 shards them
        (:func:`~peft_graft.sharding.read_entries`)."""
        out = torch.empty(indices.numel(), dtype=torch.float32)
        for attr, local, position in self.space.split(indices):
            out[position] = read_entries(getattr(self.base_layer, attr), local).float().cpu()
        return out

    def base_checksum(self, indices: torch.Tensor) -> str:
        """A checksum of the stored tensors' current values at sorted flat ``indices``, bit for bit in their dtype."""
        digest = hashlib.sha256()
        for attr, local, _ in self.space.split(indices):
            values = read_entries(getattr(self.base_layer, attr), local)
            digest.update(values.cpu().contiguous().view(torch.uint8).numpy())
        return digest.hexdigest()[:16]

    def sparse_entries(self, adapter_name: str, attr: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(local indices, values)`` of the hard region of ``adapter_name`` in stored tensor ``attr``."""
        entries = self._sparse_entries(adapter_name, attr)
        return None if entries is None else entries[:2]

    def _sparse_entries(self, adapter_name: str, attr: str) -> SparseEntries | None:
        """The entries of ``attr``, cached until the adapter's tensors change (replaced, moved or written in place):
        splitting the flat indices per tensor is Python work that every unmerged forward would otherwise repeat.

        Not cached where autograd tracks the values (they are being trained): the values are a view of
        ``graft_values``, and a cached view would either have no path back to them (taken without autograd) or keep a
        graph alive in the module.

        A packed adapter's tensors are the store's (views are made only when the cache is refreshed); the store is part
        of the stamp, so unpacking or packing anew refreshes it."""
        store = self.packed.get(adapter_name)
        if store is None:
            indices, values = self.graft_indices[adapter_name], self.graft_values[adapter_name]
            tensors = (indices, values, *self.exact_entries(adapter_name))
            if values.requires_grad and torch.is_grad_enabled():
                return entries_of(self.space, indices, values, tensors[2:], attr)
        else:
            tensors = (store, *store.tensors.values())
        stamp = tuple((t.data_ptr(), t._version, t.device) for t in (tensors if store is None else tensors[1:]))
        cached = self._entries_cache.get((adapter_name, attr))
        if (
            cached is None
            or cached[0] != stamp
            or len(cached[1]) != len(tensors)
            or any(a is not b for a, b in zip(cached[1], tensors, strict=True))
        ):
            if store is None:
                entries = entries_of(self.space, tensors[0], tensors[1], tensors[2:], attr)
            else:
                entries = entries_of(self.space, *self.entries(adapter_name), self.exact_entries(adapter_name), attr)
            cached = self._entries_cache[(adapter_name, attr)] = (stamp, tensors, entries)  # tensors: ids stay theirs
        return cached[2]

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.half()``...). The graft tensors (:data:`GRAFT_TENSORS`)
        follow ``fn`` to its device but keep their dtype, as peft keeps some adapter weights in fp32: the values stay
        the fp32 deltas that exactness and the saved format need, whatever the base layer is cast to. A packed adapter
        that ``fn`` would change (another device or dtype) is unpacked first. Before a tensor whose entries a layer
        stores is cast to another dtype, that layer's base check still due runs (the recorded checksum is of theta_pre
        in the dtype the graft was made on), and each hard region stores exactly what it would otherwise no longer give
        (:meth:`_keep_exact`): this layer's, and those of the layers storing its tied tensors."""
        # A tensor tied to another layer's (a tied LM head's weight) is cast by whichever module ``fn`` reaches first:
        # the layer storing its entries gets ready here too, before its tensors change.
        layers = {id(self): self} | {id(source): source for source, _ in self.tied_sources.values()}
        for layer in layers.values():  # a cast reaching this layer alone (GraftModel checks every layer first)
            layer.check_cast_fits(fn, f"{type(layer.base_layer).__name__}.")
        for layer in layers.values():
            layer._prepare_apply(fn)
        graft = {id(tensor) for name in GRAFT_TENSORS for tensor in getattr(self, name).values()}

        def keep_graft_dtype(tensor: torch.Tensor) -> torch.Tensor:
            out = fn(tensor)
            return tensor.to(out.device) if id(tensor) in graft and out.dtype != tensor.dtype else out

        return super()._apply(keep_graft_dtype, recurse)

    def _prepare_apply(self, fn: Any) -> None:
        """Before ``fn`` changes this layer's tensors (see :meth:`_apply`): the packed adapters it would change are
        unpacked; and where it casts a tensor this layer stores entries of to another dtype, each loaded hard region
        gets the base check still due and :meth:`_keep_exact`."""
        for adapter_name, store in list(self.packed.items()):
            if _changed_by(fn, store):
                self.unpack(adapter_name)
        if not _casts_dtype(fn, [getattr(self.base_layer, attr) for attr in self.stored_attrs]):
            return
        for adapter_name in list(self.graft_values):
            indices = self.graft_indices[adapter_name]
            loaded = not (indices.numel() and int(indices.min()) < 0)  # see update_layer
            if loaded and not self.is_learning(adapter_name):
                self._check_base_before_cast(adapter_name)
                with torch.no_grad():
                    self._keep_exact(adapter_name, fn)

    def _check_base_before_cast(self, adapter_name: str) -> None:
        """The base check of ``adapter_name`` if still due (a wrong base still raises, at first use)."""
        if self.verify_base.get(adapter_name):
            with contextlib.suppress(ValueError):  # left due: the first use raises it
                self.check_base(adapter_name)

    def _keep_exact(self, adapter_name: str, fn: Any) -> None:
        """Before ``fn`` casts the base layer: the entries of ``adapter_name`` where the cast changes theta_pre (its
        fp32 delta was made for theta_pre unrounded) join the entries stored exactly, with what the layer applies there
        now (theta_ft, fp32). The cast layer then applies theta_ft rounded to the new dtype, as casting the grafted
        model does; a cast back, a save or a load onto the original base gives theta_ft itself. On the base the graft
        was made on (its checksum), an entry where the delta added in the new dtype misses theta_ft is stored exactly
        too: a graft made on a bf16 base cast to fp32 (the delta was chosen to round to theta_ft in bf16), and a
        widening cast (fp32 to fp64: theta_pre + delta in fp64 is not theta_ft), where that is nearly every entry, so
        the graft then stores theta_ft beside each delta. A merged adapter is left as it is (its merged values are cast
        as they are)."""
        if adapter_name in self.merged_adapters:
            return
        indices, checksum = self.graft_indices[adapter_name], self.base_records(adapter_name)[1]
        made_on = checksum is not None and self.base_checksum(indices) == checksum  # the base it was made on, uncast
        positions, targets = [], []
        for attr, local, position in self.space.split(indices):
            entries = self._sparse_entries(adapter_name, attr)
            current = read_entries(getattr(self.base_layer, attr), local)
            cast, now = fn(current).to(current.device), graft_entries(current, entries, True)
            changed = cast != current
            if made_on:  # what it applies now is theta_ft: keep it where the delta would round otherwise
                changed |= graft_entries(cast, entries, True) != fn(now).to(current.device)
            changed = changed.nonzero().reshape(-1)
            positions.append(changed + position.start)
            targets.append(now[changed].float())
        old_positions, old_targets = self.exact_entries(adapter_name)
        new_positions = torch.cat(positions).cpu()
        if not new_positions.numel():
            return
        new = ~torch.isin(new_positions, old_positions.to(torch.int64).cpu())
        positions = torch.cat([old_positions.to(torch.int64).cpu(), new_positions[new]])
        targets = torch.cat([old_targets.cpu(), torch.cat(targets).cpu()[new]])
        order = positions.argsort()
        device = self.graft_values[adapter_name].device
        self.graft_exact_positions[adapter_name] = positions[order].to(device, self.space.index_dtype())
        self.graft_exact_values[adapter_name] = targets[order].to(device)
        self._forget(adapter_name)

    def _device(self) -> torch.device:
        param = next(self.base_layer.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        # Values stay fp32 whatever the base dtype (exactness), indices stay integers: move devices only.
        device = device or self._device()
        store = self.packed.get(adapter_name)
        if store is not None and store.tensors["values"].device != device:
            self.unpack(adapter_name)
        for name in GRAFT_TENSORS:
            container = getattr(self, name)
            if adapter_name in container and container[adapter_name].device != device:
                item = container[adapter_name]
                container[adapter_name] = (
                    nn.Parameter(item.to(device), requires_grad=item.requires_grad)
                    if isinstance(item, nn.Parameter)
                    else item.to(device)
                )
        if adapter_name in self.graft_learning:
            self.graft_learning[adapter_name].to(device)

    # ----------------------------------------------------------------------------------------------- checks
    def check_filled(self, adapter_name: str) -> None:
        """Refuse an adapter created empty (from a config of an existing graft) whose entries were never loaded."""
        if adapter_name not in self.awaiting_entries:
            return
        indices = self.graft_indices[adapter_name]
        if indices.numel() and int(indices.min()) < 0:
            raise ValueError(
                f"Graft {adapter_name!r} has no entries: its GraftConfig describes a graft that already exists "
                "(grafted_modules is filled in), so nothing was built from finetuned, and no weights were loaded "
                "into it. A GraftConfig builds one graft: pass a new GraftConfig(finetuned=...) to get_peft_model, "
                "or load the saved graft with PeftModel.from_pretrained(model, path)."
            )
        self.awaiting_entries.discard(adapter_name)

    def check_base(self, adapter_name: str) -> None:
        """Refuse to apply a graft whose entries were never loaded, or one made for other pre-trained values (see
        ``GraftConfig.verify_base``)."""
        self.check_filled(adapter_name)
        fingerprint, expected_checksum, verify_base = self.base_records(adapter_name)
        expected = fingerprint or []  # a config without it still has its checksum checked
        if verify_base is False or self.is_learning(adapter_name):
            return
        all_indices = self.entries(adapter_name)[0]
        indices = all_indices[: len(expected)]
        found = self.base_values(indices)
        for attr, local, position in self.space.split(indices):
            dtype = getattr(self.base_layer, attr).dtype
            want = torch.tensor(expected[position], dtype=torch.float32).to(dtype).float()
            if not torch.equal(found[position], want):
                raise ValueError(
                    f"Graft {adapter_name!r} was made for a different pre-trained model: tensor {attr!r} of "
                    f"{type(self.base_layer).__name__} holds {found[position].tolist()} at entries {local.tolist()}, "
                    f"the graft expects {want.tolist()}. Load it onto the base it was made from, or override: "
                    "config = GraftConfig.from_pretrained(path); config.verify_base = False; "
                    "PeftModel.from_pretrained(model, path, config=config)."
                )
        if expected_checksum and self.base_checksum(all_indices) != expected_checksum:
            raise ValueError(
                f"Graft {adapter_name!r} was made for a different pre-trained model: tensor values of "
                f"{type(self.base_layer).__name__} differ from the graft's theta_pre at some of its "
                f"{all_indices.numel()} grafted entries. Load it onto the base it was made from, "
                "or override: config = GraftConfig.from_pretrained(path); config.verify_base = False; "
                "PeftModel.from_pretrained(model, path, config=config)."
            )
        store = self.packed.get(adapter_name)
        if store is None:
            self.verify_base[adapter_name] = False  # checked once
        else:
            store.verify_base[self.pack_row] = 0

    # ----------------------------------------------------------------------------------------------- forward
    def _contribution(self, adapter_name: str, attr: str) -> SparseEntries | None:
        """The sparse entries of tensor ``attr`` (of the rounded region while one is being learned)."""
        learner = self.learner(adapter_name)
        if learner is not None and learner.hard is not None:
            return entries_of(self.space, *learner.hard, learner.exact_at(learner.hard[0]), attr)
        if not self.has_region(adapter_name):
            return None
        self.check_base(adapter_name)
        return self._sparse_entries(adapter_name, attr)

    def effective_parameters(
        self, adapter_names: list[str], recipes: dict[str, tuple[Any, str]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Parameters of the base layer with the given adapters grafted on, for those that change.

        ``recipes``, when given, receives ``attr -> (rebuild, source attr)`` for every override that is exactly a dense
        soft parameter of a learning adapter (``rebuild()`` recomputes the source layer's soft parameters), so that it
        can be recomputed in backward.
        """
        sources = self._sources()
        overrides = {}
        soft: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # one autograd node per (source layer, adapter)
        for attr, (layer, source_attr) in sources.items():
            param = getattr(self.base_layer, attr)
            value = param
            recipe = None
            for adapter_name in adapter_names:
                learner = layer.learner(adapter_name)
                if learner is not None and learner.hard is None:
                    key = (id(layer), adapter_name)
                    if key not in soft:
                        mode = "recompute" if self.recompute_soft_parameters else "keep"
                        soft[key] = layer.soft_parameters(adapter_name, mode)
                    if source_attr not in soft[key]:  # no search-space entry in this tensor: theta_pre
                        continue
                    # Soft graft of the learning adapter, plus what earlier adapters added to this tensor. Only dense
                    # soft parameters are recomputed in backward: a search space's are cheap to keep.
                    recipe = None
                    if value is param and learner.is_dense:
                        recipe = (_rebuilder(layer, adapter_name), source_attr)
                    value = soft[key][source_attr] if value is param else value + (soft[key][source_attr] - param)
                    continue
                contribution = layer._contribution(adapter_name, source_attr)
                if contribution is None:
                    continue
                flat, scale = value.reshape(-1), layer.get_scale(adapter_name)
                grafted = graft_entries(flat[contribution[0]], contribution, value is param, scale)
                value = flat.index_put((contribution[0],), grafted).view_as(param)
                recipe = None
            if value is not param:
                overrides[attr] = value
                if recipe is not None and recipes is not None:
                    recipes[attr] = recipe
        return overrides

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with WRITE_LOCK:  # while a forward writes entries into the base tensors, no other thread runs a graft layer
            FORWARDS.depth += 1
            try:
                if self.written_plan is None:
                    return self._forward(*args, **kwargs)
                if self._written_plan_holds():  # in_place.written_in_place wrote this layer's entries
                    return self.base_layer(*args, **kwargs)
                with suspended_writes():  # asked for another state inside the model's forward (a nested forward)
                    return self._forward(*args, **kwargs)
            finally:
                FORWARDS.depth -= 1

    def _written_plan_holds(self) -> bool:
        """Whether :meth:`in_place_plan` would return ``written_plan``, without building a plan when not (which checks
        the base, whose tensors hold grafted entries here)."""
        plan = self.written_plan
        if not GRAFT_IN_PLACE_INFERENCE or torch.is_grad_enabled() or self._disable_adapters or self.merged_adapters:
            return False
        return self._in_place_plans.get(tuple(self.active_adapters)) is plan and plan.is_current()

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.mixed_batch is not None and not self.disable_adapters:
            return layer_forward(self, self.mixed_batch, args, kwargs)
        plan = self.in_place_plan()
        if plan is not None:
            return plan.run(self.base_layer, args, kwargs)
        _refuse_sharded(self.base_layer, self.stored_attrs)  # FSDP v1: a clear error
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(*args, **kwargs)
        if self.merged:
            return self.base_layer(*args, **kwargs)
        row_adapter = self._row_learning_adapter()
        if row_adapter is not None:
            return self._embedding_rows_forward(row_adapter, *args, **kwargs)
        linear_source = self._sparse_linear_source()
        if linear_source is not None:
            return self._sparse_linear_forward(*linear_source, *args, **kwargs)
        recipes: dict[str, tuple[Any, str]] = {}
        overrides = self.effective_parameters(self.active_adapters, recipes)
        if not overrides:
            return self.base_layer(*args, **kwargs)
        if recipes and self.recompute_soft_parameters and torch.is_grad_enabled():
            sources = {
                overrides[attr].untyped_storage().data_ptr(): (overrides[attr].dtype, *recipe)
                for attr, recipe in recipes.items()
            }
            with RecomputeSoftParameters(sources):
                return self._base_with(overrides, args, kwargs)
        return self._base_with(overrides, args, kwargs)

    def _base_with(self, overrides: dict[str, torch.Tensor], args: tuple, kwargs: dict | None = None) -> Any:
        """The base layer's forward with ``overrides`` in place of its tensors (``functional_call``). Under ZeRO-3 its
        ``forward`` is called without its module hooks: this layer's forward gathered the base tensors already, and
        ZeRO-3's hooks would look for partitioned parameters among the overrides."""
        if self.is_partitioned():
            with torch.nn.utils.stateless._reparametrize_module(self.base_layer, overrides):
                return self.base_layer.forward(*args, **(kwargs or {}))
        return torch.func.functional_call(self.base_layer, overrides, args, kwargs, tie_weights=False, strict=False)

    def _sources(self) -> dict[str, tuple[GraftLayer, str]]:
        """Each tensor this layer applies -> (the layer storing its entries, its attribute there)."""
        return {attr: (self, attr) for attr in self.stored_attrs} | self.tied_sources

    def _hard_sources(self, adapters: tuple[str, ...]) -> bool:
        """Whether each of ``adapters`` has a hard region on every source layer and every tensor is contiguous (then,
        unsharded, :meth:`in_place_plan` applies)."""
        for attr, (layer, _) in self._sources().items():
            if not getattr(self.base_layer, attr).is_contiguous():
                return False
            for adapter_name in adapters:
                learner = layer.learner(adapter_name)
                if learner is not None and learner.hard is None:
                    return False
        return True

    def in_place_plan(self, adapters: tuple[str, ...] | None = None) -> InPlacePlan | None:
        """How an unmerged forward without autograd writes the grafted entries into the base tensors for the base
        forward (:class:`~peft_graft.tuner.in_place.InPlacePlan`), or ``None`` where it does not apply: autograd on,
        adapters disabled or merged, FSDP2 shards, a region still soft. The base forward then sees exactly the values
        :meth:`effective_parameters` would give it, at a cost of O(entries) instead of a copy of every grafted tensor.

        The plan is found once, with every check (``verify_base``) done before anything is written, and kept for
        later forwards while nothing it was built from changes, one per set of active adapters (so ``set_adapter``
        finds its plan again); not while an adapter learns its region, whose rounded region changes with S.
        ``adapters``: those to write (default: the active ones), e.g. one graft of a mixed batch."""
        if not GRAFT_IN_PLACE_INFERENCE or torch.is_grad_enabled() or self._disable_adapters or self.merged_adapters:
            return None
        adapters = tuple(self.active_adapters) if adapters is None else adapters
        plan = self._in_place_plans.get(adapters)
        if plan is not None and plan.is_current():
            return plan
        if _refuse_sharded(self.base_layer, self.stored_attrs) or self.is_partitioned():
            return None
        if not self._hard_sources(adapters):
            return None
        writes: list[InPlaceWrite] = []
        plan = InPlacePlan(writes)
        learning = False
        parameters = self.base_layer._parameters
        for attr, (layer, source_attr) in self._sources().items():
            plan.watch_base(parameters, attr)
            for adapter_name in adapters:
                learning = learning or layer.is_learning(adapter_name)
                contribution = layer._contribution(adapter_name, source_attr)
                if contribution is not None:
                    first = all(write[1] != attr for write in writes)  # theta_pre still sits there
                    writes.append((parameters, attr, contribution, layer.get_scale(adapter_name), first))
                entry_containers = (layer.graft_indices, layer.graft_values)
                for container in (*entry_containers, layer.graft_exact_positions, layer.graft_exact_values):
                    plan.watch(tensor_dict(container), adapter_name)
                plan.watch_slot(layer.packed, adapter_name)
                store = layer.packed.get(adapter_name)
                for key in store.tensors if store is not None else ():
                    plan.watch(store.tensors, key)
                plan.scales.append((layer.scaling, adapter_name, layer.get_scale(adapter_name)))
                plan.learning.append((layer.graft_learning._modules, adapter_name))
        if learning:
            self._in_place_plans.pop(adapters, None)
        else:
            self._in_place_plans[adapters] = plan
        return plan

    def is_partitioned(self) -> bool:
        """Whether DeepSpeed ZeRO-3 partitions the base tensors this layer grafts (then no entry is written in place:
        the whole tensors exist only within this layer's forward, which ZeRO-3 gathers as its external parameters)."""
        return any(is_partitioned(getattr(self.base_layer, attr)) for attr in self._sources())

    def _row_learning_adapter(self) -> str | None:
        """The learning adapter, when this layer is a plain ``nn.Embedding`` that only it changes: then a batch needs
        the soft values of the rows it looks up only (``soft_rows``), not of the whole matrix."""
        base = self.base_layer
        if not GRAFT_EMBEDDING_ROWS or type(base).forward is not nn.Embedding.forward:
            return None
        if base.max_norm is not None or base.sparse or self.tied_sources or self.stored_attrs != ["weight"]:
            return None
        if len(self.active_adapters) != 1:
            return None
        adapter_name = self.active_adapters[0]
        learner = self.learner(adapter_name)
        return adapter_name if learner is not None and learner.hard is None else None

    def _sparse_linear_source(self) -> tuple[GraftLayer, str] | None:
        """``(source layer, adapter)`` while a plain, frozen ``nn.Linear`` on the CPU learns a search space (its only
        active adapter, on one source layer): then its soft forward is the base forward plus ``SparseLinearDelta``,
        with no dense copy of the weight and no dense weight gradient, where that is cheaper for the layer and batch
        (fp32: ``LinearPattern.sparse_is_cheaper``; otherwise the soft weight copy). On a GPU the dense copy is faster:
        on an H200 a 1B mask step took 3.6-10x a plain SGD step with the sparse products, 1.6x with the copy
        (BENCHMARKS.md)."""
        base = self.base_layer
        if not GRAFT_SPARSE_LINEAR or not torch.is_grad_enabled() or type(base).forward is not nn.Linear.forward:
            return None
        if base.weight.device.type != "cpu":
            return None
        if len(self.active_adapters) != 1 or any(p.requires_grad for p in base.parameters(recurse=False)):
            return None
        sources = self._sources()
        layers = {id(layer) for layer, _ in sources.values()}
        if len(layers) != 1:
            return None
        layer = next(iter(sources.values()))[0]
        learner = layer.learner(self.active_adapters[0])
        if learner is None or learner.hard is not None or learner.is_dense:
            return None
        return layer, self.active_adapters[0]

    def _sparse_linear_forward(self, layer: GraftLayer, adapter_name: str, input: torch.Tensor) -> torch.Tensor:
        sources = self._sources()
        attrs = tuple(sources[attr][1] if attr in sources else None for attr in ("weight", "bias"))
        base = self.base_layer
        learner, shape = layer.graft_learning[adapter_name], (base.out_features, base.in_features)
        # fp32: the cheaper of the two paths for this layer and batch, which agree to rounding; in lower precision the
        # copy rounds theta_pre + gamma * delta to the weight's dtype, so the path must not depend on the batch.
        pattern = learner.linear_pattern(attrs, shape, input.device)
        if base.weight.dtype == torch.float32 and not pattern.sparse_is_cheaper(input.numel() // base.in_features):
            overrides = self.effective_parameters(self.active_adapters)  # the soft weight copy (GraftedSearchSpace)
            return self._base_with(overrides, (input,))
        out = base(input)
        delta = learner.linear_delta(input, attrs, shape)
        return out if delta is None else out + delta

    def _embedding_rows_forward(self, adapter_name: str, input: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        rows, inverse = torch.unique(input, return_inverse=True)
        padding_idx = None
        if base.padding_idx is not None:
            found = (rows == base.padding_idx).nonzero()
            padding_idx = int(found[0, 0]) if found.numel() else None
        weight = self.graft_learning[adapter_name].soft_rows(base.weight, rows)
        return F.embedding(inverse, weight, padding_idx, None, base.norm_type, base.scale_grad_by_freq, False)

    # ----------------------------------------------------------------------------------------------- merging
    def check_merge(self, adapter_names: list[str], safe_merge: bool = False) -> None:
        """Raise, changing nothing, if merging ``adapter_names`` here would fail: a region still being learned, the
        wrong base (``verify_base``), sharded parameters (FSDP), or with ``safe_merge`` a non-finite merged value."""
        if adapter_names:
            _refuse_sharded(self.base_layer, self.stored_attrs, merging=True)
        for adapter_name in adapter_names:
            if self.is_learning(adapter_name):
                raise ValueError(f"Adapter {adapter_name!r} is still learning its region: harden it before merging.")
            if self.has_region(adapter_name) and adapter_name not in self.merged_adapters:
                self.check_base(adapter_name)
                if safe_merge:
                    self._merged_values(adapter_name, check_finite=True)

    def _merged_values(self, adapter_name: str, check_finite: bool = False) -> list[tuple | None]:
        """Per stored tensor, ``(indices, original values, merged values)`` of ``adapter_name``, or ``None``."""
        out = []
        first = not self.merged_adapters  # theta_pre is in the base tensors: exact entries write theta_ft
        for attr in self.stored_attrs:
            entries = self._sparse_entries(adapter_name, attr) if self.has_region(adapter_name) else None
            if entries is None:
                out.append(None)
                continue
            indices = entries[0]
            flat = getattr(self.base_layer, attr).data.view(-1)
            original = flat[indices]
            with torch.no_grad():
                merged = graft_entries(original, entries, first, self.get_scale(adapter_name))
            if check_finite and not torch.isfinite(merged).all():
                raise ValueError(f"NaNs detected in the merged weights. The adapter {adapter_name} seems to be broken")
            out.append((indices, original, merged))
        return out

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Write the grafted values into the base tensors (exactly: unmerge restores the saved originals).

        Everything is checked before anything is written, so a refused merge leaves the layer as it was.
        """
        to_merge = check_adapters_to_merge(self, adapter_names)
        self.check_merge(to_merge, safe_merge)
        for adapter_name in to_merge:
            # A layer storing nothing for this adapter (e.g. only applying a tied tensor) still records the merge,
            # so that its forward does not apply the (already merged) tied entries again.
            planned = self._merged_values(adapter_name, check_finite=safe_merge)
            backup = []
            for attr, plan in zip(self.stored_attrs, planned, strict=True):
                if plan is None:
                    backup.append(None)
                    continue
                indices, original, merged = plan
                getattr(self.base_layer, attr).data.view(-1)[indices] = merged
                backup.append(original)
            self._merge_backup[adapter_name] = backup
            self.merged_adapters.append(adapter_name)

    def unmerge(self) -> None:
        """Restore the base tensors bit for bit, most recently merged adapter first (as the base was cast or moved
        since the merge: its saved originals are taken to the tensor's dtype and device)."""
        while self.merged_adapters:
            adapter_name = self.merged_adapters.pop()
            for attr, original in zip(self.stored_attrs, self._merge_backup.pop(adapter_name), strict=True):
                if original is not None:
                    indices = self.sparse_entries(adapter_name, attr)[0]
                    tensor = getattr(self.base_layer, attr).data
                    tensor.view(-1)[indices.to(tensor.device)] = original.to(tensor.device, tensor.dtype)

    def delete_adapter(self, adapter_name: str) -> None:
        self.packed.pop(adapter_name, None)  # the store is freed with the last layer reading it
        super().delete_adapter(adapter_name)
        self.fingerprints.pop(adapter_name, None)
        self.checksums.pop(adapter_name, None)
        self.verify_base.pop(adapter_name, None)
        self.awaiting_entries.discard(adapter_name)
        self.scaling.pop(adapter_name, None)
        self._in_place_plans.clear()  # frees the deleted adapter's tensors
        self._forget(adapter_name)

    def __repr__(self) -> str:
        return "graft." + super().__repr__()


def _changed_by(fn: Any, store: PackedStore) -> bool:
    """Whether ``fn`` (of ``nn.Module._apply``) would convert a tensor of ``store`` (probed on empty views)."""
    for tensor in store.tensors.values():
        probe = tensor[:0]
        if fn(probe) is not probe:
            return True
    return False


def _casts_dtype(fn: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether ``fn`` (of ``nn.Module._apply``) casts any of the floating-point ``tensors`` to another dtype (probed on
    an empty tensor of each one's dtype). Each is probed: a tied tensor may have been cast already, the others not."""
    for tensor in tensors:
        if tensor.is_floating_point() and not is_sharded(tensor):
            probe = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            if fn(probe).dtype != tensor.dtype:
                return True
    return False


PACKED_STATE = threading.local()
"""``PACKED_STATE.omit = True``: ``state_dict()`` leaves packed adapters out in this thread (see
``GraftModel._remap_adapter_state_dict_for_load``)."""


def _packed_state_dict(layer: GraftLayer, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State dict hook: a packed adapter's tensors under the keys its own tensors would have (views of its store, as
    cheap as the references ``state_dict()`` gives of other tensors; saving copies them, ``GraftModel.
    _get_adapter_state_dict``), so that its saved files and ``state_dict()`` are those of the unpacked adapter."""
    if getattr(PACKED_STATE, "omit", False):
        return
    row = layer.pack_row
    for adapter_name, store in layer.packed.items():
        indices, values = store.entries(row)
        state_dict[f"{prefix}graft_values.{adapter_name}"] = values
        state_dict[f"{prefix}graft_indices.{adapter_name}"] = indices
        exact = store.exact_entries(row)
        if exact is not None:
            state_dict[f"{prefix}graft_exact_positions.{adapter_name}"] = exact[0]
            state_dict[f"{prefix}graft_exact_values.{adapter_name}"] = exact[1]


def _unpack_loaded(layer: GraftLayer, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load state dict pre-hook: a packed adapter whose tensors are loaded gets its own tensors first (to load into)."""
    for adapter_name in list(layer.packed):
        if any(f"{prefix}{name}.{adapter_name}" in state_dict for name in GRAFT_TENSORS):
            layer.unpack(adapter_name)


def check_scale(scale: object, name: str = "scale") -> float:
    """``scale`` as a float: a finite real number (``bool`` refused), else ``TypeError``/``ValueError`` naming it."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(scale).__name__}: {scale!r}.")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale!r}.")
    return float(scale)


def _rebuilder(layer: GraftLayer, adapter_name: str):
    """A function recomputing ``layer``'s soft parameters of ``adapter_name`` (for ``RecomputeSoftParameters``)."""
    return lambda: layer.soft_parameters(adapter_name, "rebuild")


def _sharding(base_layer: nn.Module, stored_attrs: list[str]) -> str | None:
    """``"FSDP v1"``, ``"FSDP2"`` or ``None``: how the base layer's parameters are sharded, as the graft sees them.

    FSDP v1 swaps views of its flat parameter into the module around each forward: plain tensors in the module's
    parameter dict (``use_orig_params`` True or False), which the graft's substitution does not reach (the output is
    then neither the graft's nor the base model's); outside the forward it marks them ``_fsdp_flattened``. FSDP2 keeps
    sharded ``DTensor`` parameters outside the forward and unshards them into ordinary parameters for it, so an
    unmerged graft's forward is exact (``tests/test_fsdp.py``), but merging would write into shards."""
    if not stored_attrs:
        return None
    param = base_layer._parameters.get(stored_attrs[0])
    if not isinstance(param, nn.Parameter) or getattr(param, "_fsdp_flattened", False):
        return "FSDP v1"
    if is_sharded(param):
        return "FSDP2"
    return None


def _refuse_sharded(base_layer: nn.Module, stored_attrs: list[str], merging: bool = False) -> str | None:
    """FSDP v1 is refused at every use of a graft layer; FSDP2 only when merging (see :func:`_sharding`). Returns the
    sharding allowed (``"FSDP2"``) or ``None``."""
    sharding = _sharding(base_layer, stored_attrs)
    if sharding == "FSDP v1" or (sharding and merging):
        what = "runs under FSDP v1" if sharding == "FSDP v1" else "is sharded by FSDP2 and cannot be merged"
        raise ValueError(
            f"A graft layer ({type(base_layer).__name__}) {what}, which peft_graft does not support: the graft would "
            "not apply as it should. Use DDP (torchrun or accelerate launch without fsdp) or FSDP2 (fully_shard) "
            "for unmerged forward passes, or merge the graft first (merge_and_unload()) and shard the plain model."
        )
    return sharding


def graft_state_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding a graft's own state in ``model``: each graft layer's values and learning state (S), and the
    copies of heads stored whole (``modules_to_save``). Under FSDP2 they stay whole on every process (FSDP's ignored
    parameters): they are small beside the model (S on a search space, a hard region), read whole by hardening and
    saving, and replaced when a region is hardened, which FSDP's own copies would undo."""
    modules: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, GraftLayer):
            modules += [module.graft_values, module.graft_learning]
        elif isinstance(module, ModulesToSaveWrapper):
            modules.append(module.modules_to_save)
    return modules
