"""The graft tuner: injects the planned graft layers, switches, combines and hardens adapters, saves and loads."""

from __future__ import annotations

import copy
import functools
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from peft.tuners.tuners_utils import BaseTuner
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

from ..parameter_layout import NO_ENTRIES, PEFT_PREFIX, build_layout, num_base_parameters, peft_free_name
from ..regions import Region
from ..scores.movement import saved_whole_module
from ..sharding import deepspeed_refusal, gathered, is_partitioned, refuse_deepspeed
from . import provenance
from .config import GRAFT_PREFIX, GraftConfig, _check_count
from .entries import check_entries
from .in_place import WRITE_LOCK, model_forward, state_change, suspended_writes, written_in_place
from .layer import GRAFT_TENSORS, PACKED_STATE, GraftLayer, check_scale
from .learning import RegionLearner, harden_exact
from .mixed_batch import BASE, MIXED_BATCH_MODES, mixed_batch_hooks
from .packed import pack_adapter, release_free_heap
from .planning import Plan, plan_loaded_graft, plan_new_graft

COMBINATION_RULES = ("average", "sum", "first", "last")


def changes_state(structural: bool = True) -> Callable:
    """Decorate a ``GraftModel`` method that changes the model's state: it runs under the lock every forward holds,
    so threads serving the model never see part of it; a ``structural`` one is refused inside a forward
    (:func:`~peft_graft.tuner.in_place.state_change`)."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def locked(self, *args, **kwargs):
            with state_change(f"{method.__name__}()", structural):
                try:
                    return method(self, *args, **kwargs)
                finally:
                    self._state_version = getattr(self, "_state_version", 0) + 1

        return locked

    return decorate


class GraftModel(BaseTuner):
    """Grafts sparse regions of a fine-tuned model onto a pre-trained one (Panigrahi et al., ICML 2023).

    Created through ``peft.get_peft_model(model, GraftConfig(finetuned=..., sparsity=...))`` once ``peft_graft`` is
    imported. Every parameter tensor of the model can be grafted (Linear, GPT-2 Conv1D, embeddings, norms, biases,
    tied weights), each tensor once.
    """

    prefix: str = GRAFT_PREFIX
    tuner_layer_cls = GraftLayer
    target_module_mapping: dict = {}

    # ------------------------------------------------------------------------------------------ injection
    @changes_state()
    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        config: GraftConfig = self.peft_config[adapter_name]
        try:
            check_adapter_name(adapter_name)
        except ValueError:
            del self.peft_config[adapter_name]
            raise
        shared = [name for name, other in self.peft_config.items() if other is config and name != adapter_name]
        if shared:
            del self.peft_config[adapter_name]
            raise ValueError(
                f"This GraftConfig object already describes adapter {shared[0]!r} (a graft records its entries in its "
                f"config): give adapter {adapter_name!r} its own GraftConfig(finetuned=..., ...), or load a saved "
                "graft with load_adapter."
            )
        try:
            _check_no_graft_layer_stored_whole(model, config, adapter_name)
            _check_modules_to_save_not_nested(model, config, adapter_name)
        except ValueError:
            del self.peft_config[adapter_name]
            raise
        # A model ZeRO-3 partitioned as it loaded (zero.Init) is gathered whole on every process while the graft is
        # built (a collective: every process creates or loads it); the graft's own tensors stay whole.
        with gathered(list(model.parameters())):
            self._inject_graft(model, adapter_name, config, autocast_adapter_dtype, low_cpu_mem_usage)

    def _inject_graft(
        self,
        model: nn.Module,
        adapter_name: str,
        config: GraftConfig,
        autocast_adapter_dtype: bool,
        low_cpu_mem_usage: bool,
    ) -> None:
        """Plan the graft and inject its layers (the model's tensors whole)."""
        layout = build_layout(model)
        if config.is_created:
            self._plan = plan_loaded_graft(config, layout, model, adapter_name)
        else:
            self._plan = plan_new_graft(model, config, layout)
        if config.is_created:
            _check_saved_whole(config, adapter_name, self._plan.targets)
        # The config fully determines the targets; peft's key-based injection from a state dict would miss tied users.
        super().inject_adapter(model, adapter_name, autocast_adapter_dtype, low_cpu_mem_usage, state_dict=None)
        # Found again: peft's set_adapter above ran before it wrapped this adapter's modules_to_save (a new head).
        self._adapter_modules_cache = None
        if not config.is_created:
            self._finish_creation(model, config, adapter_name)
        del self._plan

    def _prepare_adapter_config(self, peft_config: GraftConfig, model_config: dict) -> GraftConfig:
        return peft_config  # targets come from the plan, not from target_modules

    def _check_target_module_exists(self, peft_config: GraftConfig, key: str) -> bool:
        return key in self._plan.targets

    def _create_and_replace(self, config, adapter_name, target, target_name, parent, current_key, **kwargs) -> None:
        plan = self._plan
        tied = {}
        for attr, (module, source_attr) in plan.layout.tied.get(current_key, {}).items():
            source = self.model.get_submodule(module)  # storage modules come first in module order
            if isinstance(source, GraftLayer):
                tied[attr] = (source, source_attr)
        if isinstance(target, GraftLayer):
            layer = target
            layer.tied_sources.update(tied)
        else:
            layer = GraftLayer(target, plan.layout.stored.get(current_key, []), tied)
            self._replace_module(parent, target_name, layer, target)
        if current_key in plan.regions:
            layer.set_region(adapter_name, *plan.regions[current_key], plan.unreachable.get(current_key, NO_ENTRIES))
        elif current_key in plan.entries:
            fingerprint = config.base_fingerprint.get(current_key, [])
            checksum = config.base_checksum.get(current_key)
            num_exact = config.exact_entries.get(current_key, 0)
            layer.update_layer(
                adapter_name, plan.entries[current_key], fingerprint, config.verify_base, checksum, num_exact
            )
        if current_key in plan.learning:
            learning = plan.learning[current_key]
            # Seeded by module name: the same S on every process, whatever the order modules are visited in.
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + zlib.crc32(current_key.encode()))
            learner = RegionLearner(
                layer.space,
                learning.movement,
                learning.base_region,
                config.score_init,
                learning.search_indices,
                config.score_init_width,
                generator,
                learning.unreachable,
            )
            layer.start_learning(adapter_name, learner)
        if adapter_name not in self.active_adapters:
            layer.requires_grad_(False)

    def _replace_module(self, parent, child_name, new_module, child) -> None:
        if isinstance(new_module, GraftLayer):
            return super()._replace_module(parent, child_name, new_module, child)
        # Unloading gives back a module as it is (a base layer, or a modules_to_save copy such as RoBERTa's head,
        # which has no `.weight` for peft's default to rebind): nothing to rebind or move.
        setattr(parent, child_name, new_module)
        return None

    def _finish_creation(self, model: nn.Module, config: GraftConfig, adapter_name: str) -> None:
        for name, tensor in self._plan.saved_whole.items():
            copy = _modules_to_save_tensor(model, name, adapter_name)
            if copy is None:
                raise ValueError(f"{name!r} belongs to modules_to_save but peft did not wrap its module.")
            copy.data.copy_(tensor)
        _record_layout(model, config, adapter_name)
        config.region_provenance = _creation_provenance(self._plan, config, model)
        config._finetuned = config._given_region = config._region_scores = None  # never needed again
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(["graft", "skill-localization"])

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.half()``, ``.to(dtype)``...), refused before any tensor changes when it casts a
        grafted value beyond the new dtype's range (:meth:`GraftLayer.check_cast_fits`, naming the tensor)."""
        for name, layer in self.model.named_modules():
            if isinstance(layer, GraftLayer):
                layer.check_cast_fits(fn, f"{name}.")
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        """The model's forward; without autograd, with the grafts' entries written in place once for the whole forward
        (:func:`~peft_graft.tuner.in_place.written_in_place`) rather than around each layer's."""
        layers = self._adapter_modules()[0]  # cached; ZeRO-3 partitions every parameter: one shows it
        first = next(iter(layers[0].base_layer._parameters.values()), None) if layers else None
        if first is not None and is_partitioned(first):
            check_zero3_forward(layers)
            with model_forward(self):  # nothing written in place: ZeRO-3 gathers each layer's tensors for its forward
                return self.model.forward(*args, **kwargs)
        with model_forward(self), written_in_place(self._graft_layers_for_inference()):
            return self.model.forward(*args, **kwargs)

    @property
    def generate(self) -> Callable:
        """The model's ``generate`` (which runs without autograd), with the grafts' entries written in place once for
        the whole generation. Absent (``AttributeError``) when the model has none, as before."""
        generate = self.model.generate

        @functools.wraps(generate)
        def generate_with_grafts_written(*args, **kwargs):
            with torch.no_grad(), model_forward(self), written_in_place(self._graft_layers_for_inference()):
                return generate(*args, **kwargs)

        return generate_with_grafts_written

    def _graft_layers_for_inference(self) -> list[GraftLayer]:
        """The graft layers, when a forward runs without autograd (finding them costs nothing otherwise), and not in a
        mixed batch (whose layers write each graft around their own calls)."""
        if torch.is_grad_enabled() or self.__dict__.get("mixed_batch") is not None:
            return []
        return self._adapter_modules()[0]

    # peft's mixed-batch inference: peft_model(**inputs, adapter_names=[...]), one graft (or "__base__") per example
    _enable_peft_forward_hooks = mixed_batch_hooks

    def set_mixed_batch_mode(self, mode: str) -> None:
        """How mixed-graft batches run: ``"sparse_delta"`` (the default: a linear layer whose grafts are sparse enough
        for the call runs once per batch plus each graft's sparse delta, differing from ``"exact"`` by rounding only
        within a stated bound; ``peft_graft/tuner/mixed_batch.py``) or ``"exact"`` (each graft layer bit-exact per
        example as with its graft alone, slower: each graft layer runs once per graft)."""
        if mode not in MIXED_BATCH_MODES:
            raise ValueError(f"mixed batch mode must be one of {MIXED_BATCH_MODES}, got {mode!r}.")
        with WRITE_LOCK:  # not while a mixed batch runs in another thread
            self.mixed_batch_mode = mode

    def forward_state(self) -> tuple:
        """What a forward's output depends on besides the tensors: each graft layer's and head's active adapters,
        whether adapters are disabled, the scales. Found again only after a change of state (``changes_state``)."""
        version = getattr(self, "_state_version", 0)
        cached = getattr(self, "_forward_state_cache", None)
        if cached is None or cached[0] != version:
            layers, wrappers = self._adapter_modules()
            state = tuple(
                (tuple(layer.active_adapters), layer.disable_adapters, tuple(sorted(layer.scaling.items())))
                for layer in layers
            ) + tuple((tuple(wrapper.active_adapters), wrapper.disable_adapters) for wrapper in wrappers)
            cached = self._forward_state_cache = (version, state)
        return cached[1]

    # ------------------------------------------------------------------------------------------ adapters
    @changes_state(structural=False)
    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        """Activate adapter(s), as peft's ``set_adapter`` does, without walking every module of the model each time.

        The graft layers and ``modules_to_save`` wrappers are found once per set of adapters (peft walks all modules
        twice per call), and each layer writes only the ``requires_grad`` flags that change (peft writes every
        adapter's): a switch costs a flag check per adapter tensor.
        """
        layers, wrappers = self._adapter_modules()
        for wrapper in wrappers:  # as peft.utils.other._set_adapter
            name = wrapper.check_set_adapter(adapter_name)
            wrapper.set_adapter(name if name in wrapper._adapters else [], inference_mode=inference_mode)
        for layer in layers:
            if layer.merged_adapters:
                warnings.warn("Adapter cannot be set while merged: unmerging first.", stacklevel=2)
                layer.unmerge()
            layer.set_adapter(adapter_name, inference_mode=inference_mode)
        self.active_adapter = adapter_name

    @changes_state()
    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """peft's ``merge_adapter``, all or nothing: every layer is checked before any is merged, and a failure part
        way leaves every layer as it was."""
        self._check_merge(adapter_names, safe_merge)
        layers, _ = self._adapter_modules()
        before = {id(layer): list(layer.merged_adapters) for layer in layers}
        try:
            super().merge_adapter(adapter_names=adapter_names, safe_merge=safe_merge)
        except BaseException:
            for layer in layers:
                if layer.merged_adapters != before[id(layer)]:
                    layer.unmerge()
                    if before[id(layer)]:
                        layer.merge(adapter_names=before[id(layer)])
            raise

    @changes_state()
    def unmerge_adapter(self) -> None:
        """peft's ``unmerge_adapter``, under the lock forwards hold."""
        super().unmerge_adapter()

    @changes_state(structural=False)
    def enable_adapter_layers(self) -> None:
        """peft's ``enable_adapter_layers``, under the lock forwards hold."""
        super().enable_adapter_layers()

    @changes_state(structural=False)
    def disable_adapter_layers(self) -> None:
        """peft's ``disable_adapter_layers``, under the lock forwards hold."""
        super().disable_adapter_layers()

    @changes_state()
    def _unload_and_optionally_merge(self, merge=True, progressbar=False, safe_merge=False, adapter_names=None):
        if merge:  # check every layer first: peft merges and unwraps module by module
            self._check_merge(adapter_names, safe_merge)
        self._adapter_modules_cache = None  # the layers leave the model
        return super()._unload_and_optionally_merge(merge, progressbar, safe_merge, adapter_names)

    def _check_merge(self, adapter_names: list[str] | None, safe_merge: bool) -> None:
        refuse_deepspeed("Merging a graft", self.model, running=False)  # FSDP is refused by each layer
        names = adapter_names if adapter_names is not None else self.active_adapters
        for layer in self._adapter_modules()[0]:
            layer.check_merge(names, safe_merge)

    @changes_state()
    def delete_adapter(self, adapter_name: str) -> None:
        """peft's ``delete_adapter``; the last adapter cannot be deleted (a graft model without one has no forward)."""
        if adapter_name in self.peft_config and len(self.peft_config) == 1:
            raise ValueError(
                f"Adapter {adapter_name!r} is the only adapter: deleting it would leave a graft model that cannot run. "
                "Use unload() to get the base model back, or add another adapter first."
            )
        was_packed = any(adapter_name in layer.packed for layer in self._adapter_modules()[0])
        super().delete_adapter(adapter_name)
        if was_packed:
            release_free_heap()

    @changes_state()
    def pack_adapter(self, adapter_name: str) -> int:
        """Hold the frozen hard region of ``adapter_name`` in one flat store (``tuner/packed.py``) instead of small
        tensors on every layer, so that it costs about its bytes in memory; outputs, merges and saved files stay bit
        for bit the same. Loads for inference (``is_trainable=False``) do it; a layer unpacks before anything could
        train the adapter (``set_adapter`` without ``inference_mode``, ``set_requires_grad``) or change its tensors.
        Layers where the adapter is trainable or learning its region are left as they are. Returns the bytes packed."""
        self._check_adapter(adapter_name)
        packed = sum(store.nbytes() for store in pack_adapter(self._adapter_modules()[0], adapter_name))
        release_free_heap()  # what loading and packing freed (see release_free_heap)
        return packed

    @changes_state()
    def unpack_adapter(self, adapter_name: str) -> None:
        """Give ``adapter_name`` its own tensors on every layer again (undoes :meth:`pack_adapter`)."""
        self._check_adapter(adapter_name)
        for layer in self._adapter_modules()[0]:
            layer.unpack(adapter_name)

    def _adapter_modules(self) -> tuple[list[GraftLayer], list[AuxiliaryTrainingWrapper]]:
        key = tuple(self.peft_config)  # layers and wrappers only change when adapters are added or deleted
        cached = getattr(self, "_adapter_modules_cache", None)
        if cached is None or cached[0] != key:
            modules = list(self.model.modules())
            layers = [m for m in modules if isinstance(m, GraftLayer)]
            wrappers = [m for m in modules if isinstance(m, AuxiliaryTrainingWrapper)]
            cached = self._adapter_modules_cache = (key, layers, wrappers)
        return cached[1], cached[2]

    # ------------------------------------------------------------------------------------------ scale
    @changes_state(structural=False)
    def set_scale(self, scale: float, adapter_name: str | None = None) -> None:
        """Apply an adapter (default: the active one(s)) at run-time ``scale``: ``theta_pre + scale * delta`` on its
        region, as LoRA's ``set_scale``. Also reached as ``peft_model.set_scale(...)``.

        ``scale = alpha`` in [0, 1] is WiSE-graft (interpolating the grafted and the pre-trained model); any finite real
        is allowed (``> 1`` extrapolates, ``< 0`` negates the graft, as in task arithmetic). Merging merges the scaled
        values. Run-time only: never saved, a loaded graft has scale 1. Heads stored whole (``modules_to_save``) are
        not scaled. Refused, changing nothing, for an unknown adapter, one merged (unmerge first) or one learning its
        region.
        """
        scale = check_scale(scale)
        names = self._scale_adapters(adapter_name)
        layers = self._adapter_modules()[0]
        for name in names:
            for layer in layers:
                if name in layer.merged_adapters or layer.is_learning(name):
                    layer.set_scale(name, scale)  # raises the error that says why
        with suspended_writes():  # theta_pre in the base tensors, also when called around a nested forward
            for name in names:
                for layer in layers:
                    layer.check_scale_fits(name, scale)
        for name in names:
            for layer in layers:
                layer.set_scale(name, scale)

    def get_scale(self, adapter_name: str | None = None) -> float:
        """The run-time scale of an adapter (default: the first active one); 1.0 unless :meth:`set_scale` changed it."""
        name = self._scale_adapters(adapter_name)[0]
        scales = {layer.get_scale(name) for layer in self._adapter_modules()[0] if layer.has_region(name)}
        if len(scales) > 1:
            raise ValueError(f"The graft layers of adapter {name!r} have different scales {sorted(scales)}.")
        return scales.pop() if scales else 1.0

    @contextmanager
    def scaled(self, scale: float, adapter_name: str | None = None) -> Iterator[None]:
        """Context manager: :meth:`set_scale` on entry, the previous scale(s) restored on exit (also on an exception).

        ``with model.scaled(0.5): model(**batch)``. Unmerge before leaving the block if merged inside it.
        """
        names = self._scale_adapters(adapter_name)
        previous = {name: self.get_scale(name) for name in names}
        self.set_scale(scale, adapter_name)  # all or nothing
        try:
            yield
        finally:
            for name, value in previous.items():
                self.set_scale(value, name)

    def _scale_adapters(self, adapter_name: str | None) -> list[str]:
        names = list(self.active_adapters) if adapter_name is None else [adapter_name]
        for name in names:
            self._check_adapter(name)
        return names

    # ------------------------------------------------------------------------------------------ regions
    def graft_layers(self) -> dict[str, GraftLayer]:
        """Graft layers by module name (relative to the base model)."""
        return {name: m for name, m in self.model.named_modules() if isinstance(m, GraftLayer)}

    def region_learners(self, adapter_name: str | None = None) -> dict[str, RegionLearner]:
        """The learning state of an adapter's region, by module name (empty once the region is hard)."""
        adapter_name = adapter_name or self.active_adapters[0]
        learners = {module: layer.learner(adapter_name) for module, layer in self.graft_layers().items()}
        return {module: learner for module, learner in learners.items() if learner is not None}

    def get_region(self, adapter_name: str | None = None) -> Region:
        """The hard region of an adapter, by parameter name (a learning adapter is rounded, paper section 3)."""
        adapter_name = adapter_name or self.active_adapters[0]
        self._check_adapter(adapter_name)
        layout = build_layout(self.model)
        region = {}
        for module, layer in self.graft_layers().items():
            for attr, local in layer.region_by_tensor(adapter_name).items():
                region[layout.by_site[(module, attr)].name] = local
        return Region(region)

    @changes_state()
    def harden_region(
        self,
        adapter_name: str | None = None,
        num_entries: int | None = None,
        entries: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> int:
        """Turn a learned region into a hard sparse graft (``round(gamma)``, or the top ``num_entries`` of gamma).

        ``entries`` (module -> flat indices, values), when given, is the hard region to keep instead (e.g. the best
        mask seen by ``MaskTrainer``). Returns the number of grafted entries. The learning state is released.
        """
        adapter_name = adapter_name or self.active_adapters[0]
        learners = self.region_learners(adapter_name)
        if not learners:
            raise ValueError(f"Adapter {adapter_name!r} has no region being learned (GraftConfig(learn_region=True)).")
        hardened = entries
        if hardened is not None:  # every module checked before any stops learning
            unknown = sorted(set(hardened) - set(learners))
            if unknown:
                raise ValueError(f"entries names modules without a region being learned: {unknown[:3]}.")
            for module, (indices, values) in hardened.items():
                size = self.model.get_submodule(module).num_stored
                check_entries(indices, values, size, f"entries[{module!r}]")
        elif num_entries is not None:
            _check_count("num_entries", num_entries)
            moved = sum(int(learner.moved().sum()) for learner in learners.values())
            if not 1 <= num_entries <= moved:
                raise ValueError(f"num_entries={num_entries} must lie in [1, {moved}] (the moved entries).")
            hardened = harden_exact(learners, num_entries)
        total = 0
        for module, learner in learners.items():
            indices, values = hardened.get(module, NO_ENTRIES) if hardened is not None else learner.harden()
            layer = self.model.get_submodule(module)
            layer.stop_learning(adapter_name)
            layer.set_region(adapter_name, indices, values, learner.unreachable)
            total += int(indices.numel())
        config = self.peft_config[adapter_name]
        _record_layout(self.model, config, adapter_name)
        config.learn_region = False
        kept = "given entries" if entries is not None else "round(gamma)" if num_entries is None else None
        config.region_provenance = {
            **(config.region_provenance or {"strategy": config.region}),
            "learned": True,
            "kept": kept or "top num_entries of gamma",
        }
        return total

    @changes_state()
    def add_combined_adapter(
        self,
        adapter_names: list[str],
        combined_name: str,
        combination: str | Callable[[torch.Tensor], torch.Tensor] = "average",
    ) -> Region:
        """Add an adapter grafting the union of several grafts' regions (paper section 5.1, "region unions").

        On entries in several regions the values are combined by ``combination``: ``"average"`` (default),
        ``"sum"``, ``"first"``, ``"last"``, or a callable mapping a ``(num_grafts_there, n)`` tensor to ``(n,)``.
        Heads stored whole (``modules_to_save``) are combined entry by entry by the same rule (``"first"``: the
        first graft's head); a graft without its own copy of a head contributes the base model's.
        peft's ``add_weighted_adapter`` only exists for LoRA-like methods, hence this method.
        """
        check_adapter_name(combined_name)
        if combined_name in self.peft_config:
            raise ValueError(f"An adapter named {combined_name!r} already exists.")
        if not callable(combination) and combination not in COMBINATION_RULES:
            raise ValueError(f"Unknown combination={combination!r}: use one of {COMBINATION_RULES} or a callable.")
        if isinstance(adapter_names, str) or not adapter_names:
            raise ValueError(f"adapter_names must be a non-empty list of adapter names, got {adapter_names!r}.")
        for name in adapter_names:
            self._check_adapter(name)
        regions = {}  # computed whole before the model changes, so that a failing combination leaves no trace
        for module, layer in self.graft_layers().items():
            entries = [layer.entries(name) for name in adapter_names]
            indices = torch.unique(torch.cat([e[0].to(torch.int64) for e in entries]))
            if indices.numel() == 0:
                continue
            stacked = torch.full((len(entries), indices.numel()), torch.nan)
            exact = torch.full((len(entries), indices.numel()), torch.nan)  # theta_ft of entries stored exactly
            for row, (idx, val) in enumerate(entries):
                columns = torch.searchsorted(indices, idx.to(torch.int64))
                stacked[row, columns] = val.detach().float().cpu()
                positions, targets = layer.exact_entries(adapter_names[row])
                exact[row, columns[positions.to(torch.int64).cpu()]] = targets.float().cpu()
            values = _combine(stacked, combination)
            regions[module] = (indices, values, _exact_after_combining(stacked, exact, values, indices))
        heads = _combined_heads(self.model, adapter_names, combination)
        config = copy.copy(self.peft_config[adapter_names[0]])
        config.inference_mode, config.learn_region = True, False
        rule = combination if isinstance(combination, str) else getattr(combination, "__name__", "callable")
        config.region_provenance = {
            "strategy": "union",
            "learned": False,
            "kept": "combination",
            "combined_from": list(adapter_names),
            "combination": str(rule),
        }
        self.peft_config[combined_name] = config
        try:
            for module, (indices, values, unreachable) in regions.items():
                layer = self.model.get_submodule(module)
                layer.set_region(combined_name, indices, values, unreachable)
                layer.graft_values[combined_name].requires_grad_(False)
            for wrapper, tensors in heads:
                wrapper.update(combined_name)
                for name, tensor in tensors.items():
                    wrapper.modules_to_save[combined_name].get_parameter(name).data.copy_(tensor)
                wrapper.modules_to_save[combined_name].requires_grad_(False)
            _record_layout(self.model, config, combined_name)
        except BaseException:
            del self.peft_config[combined_name]
            for layer in self.graft_layers().values():
                layer.delete_adapter(combined_name)
            for wrapper, _ in heads:
                if combined_name in wrapper.modules_to_save:
                    del wrapper.modules_to_save[combined_name]
                    wrapper._adapters.discard(combined_name)
            raise
        self.model.peft_config = self.peft_config
        return self.get_region(combined_name)

    def graft_stats(self, adapter_name: str | None = None):
        """Grafted entries per tensor, layer and module type, and overall sparsity (see :class:`GraftStats`)."""
        from ..analysis.stats import compute_graft_stats  # analysis reads the tuner, not the other way round

        adapter_name = adapter_name or self.active_adapters[0]
        self._check_adapter(adapter_name)
        return compute_graft_stats(self.model, self.get_region(adapter_name), adapter_name)

    def _check_adapter(self, adapter_name: str) -> None:
        if adapter_name not in self.peft_config:
            raise ValueError(f"No adapter named {adapter_name!r}; existing: {sorted(self.peft_config)}.")

    # ------------------------------------------------------------------------------------------ saving / loading
    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        """Only the hard region is saved; a region still being learned is rounded first (paper section 3)."""
        for module in model.modules():
            if isinstance(module, GraftLayer):
                module.check_filled(adapter_name)
        out = super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        out = {k: v for k, v in out.items() if f".{GRAFT_PREFIX}learning." not in k}
        for key, tensor in out.items():  # views of a packed adapter's store: their own storage, as safetensors needs
            nbytes = tensor.numel() * tensor.element_size()
            if f".{GRAFT_PREFIX}" in key and tensor.untyped_storage().nbytes() != nbytes:
                out[key] = tensor.clone()
        for name, module in model.named_modules():
            if isinstance(module, GraftLayer) and module.is_learning(adapter_name):
                for attr in GRAFT_TENSORS:  # what the layer registered for gamma_base: the region now replaces it
                    out.pop(f"{name}.{attr}.{adapter_name}", None)
                indices, values = module.entries(adapter_name)
                if not indices.numel():  # no entry here now: not listed by _record_layout, not saved
                    continue
                index_dtype = module.space.index_dtype()
                out[f"{name}.graft_indices.{adapter_name}"] = indices.to(index_dtype)
                out[f"{name}.graft_values.{adapter_name}"] = values
                positions, targets = module.exact_entries(adapter_name, indices)
                if positions.numel():
                    out[f"{name}.graft_exact_positions.{adapter_name}"] = positions.to(index_dtype)
                    out[f"{name}.graft_exact_values.{adapter_name}"] = targets
        _record_layout(model, config, adapter_name)
        return out

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        """Check the checkpoint against the config and the model before anything is loaded; a packed adapter gets its
        own tensors back to load into (peft maps the keys onto the model's tensors of the adapter)."""
        check_graft_state_dict(model, config, state_dict, adapter_name)
        for module in model.modules():
            if isinstance(module, GraftLayer):
                module.unpack(adapter_name)
        # peft maps the keys through model.state_dict(), where only this (now unpacked) adapter's keys matter: the
        # views of every packed graft would cost the n-th load about a tensor object per tensor of the n - 1 others.
        PACKED_STATE.omit = True
        try:
            return super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        finally:
            PACKED_STATE.omit = False


def check_graft_tensors(
    config: GraftConfig, layers: dict[str, GraftLayer], tensor: Callable[[str, str], torch.Tensor | None]
) -> None:
    """Check the tensors of one graft (``tensor(module, "graft_indices")`` etc.) against its config and its layers."""
    for module, count in config.grafted_modules.items():
        indices, values = tensor(module, "graft_indices"), tensor(module, "graft_values")
        if indices is None or values is None:
            raise ValueError(f"The adapter file has no graft entries for module {module!r}: it is incomplete.")
        validate_entries(indices, values, count, layers[module].num_stored, module)
        num_exact = config.exact_entries.get(module, 0)
        positions, targets = tensor(module, "graft_exact_positions"), tensor(module, "graft_exact_values")
        if num_exact or positions is not None or targets is not None:
            if positions is None or targets is None:
                raise ValueError(
                    f"Module {module!r}: the adapter config records {num_exact} entries stored as theta_ft but the "
                    "file lacks graft_exact_positions/graft_exact_values: config and weights do not match."
                )
            validate_entries(positions, targets, num_exact, count, module, "exact entries")


def check_graft_state_dict(
    model: nn.Module, config: GraftConfig, state_dict: dict[str, torch.Tensor], adapter_name: str
) -> None:
    """Check a graft's saved tensors (keys as peft saves them, with or without its prefix) against config and model:
    the entries, and the heads stored whole (``modules_to_save``) of adapter ``adapter_name``."""
    layers = {n.removeprefix(PEFT_PREFIX): m for n, m in model.named_modules() if isinstance(m, GraftLayer)}

    def tensor(module: str, name: str) -> torch.Tensor | None:
        return state_dict.get(f"{PEFT_PREFIX}{module}.{name}", state_dict.get(f"{module}.{name}"))

    holding = set()
    for key, value in state_dict.items():
        module, _, name = key.removeprefix(PEFT_PREFIX).rpartition(".")
        if name in GRAFT_TENSORS and not (isinstance(value, torch.Tensor) and value.numel() == 0):
            holding.add(module)
    unlisted = sorted(holding - set(config.grafted_modules))  # modules without entries are not listed
    if unlisted:
        raise ValueError(
            f"The adapter file holds graft entries of {len(unlisted)} modules its config's grafted_modules does not "
            f"list (e.g. {unlisted[0]!r}): config and weights do not match. Save or download the adapter again."
        )
    check_graft_tensors(config, layers, tensor)
    for name, module in model.named_modules():  # heads stored whole: present, floating point, of their shape, finite
        if not isinstance(module, AuxiliaryTrainingWrapper) or adapter_name not in module.modules_to_save:
            continue
        module_name = name.removeprefix(PEFT_PREFIX)
        for attr, parameter in module.modules_to_save[adapter_name].named_parameters():
            value = tensor(module_name, attr)  # as saved; as peft's load renames it
            value = value if value is not None else tensor(module_name, f"modules_to_save.{adapter_name}.{attr}")
            where = f"The adapter file's head tensor {module_name}.{attr} (stored whole, modules_to_save)"
            if not torch.is_tensor(value):
                raise ValueError(f"{where} is missing: the file is incomplete. Save or download the adapter again.")
            if not value.is_floating_point() or tuple(value.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"{where} is {value.dtype} of shape {tuple(value.shape)}, not floating point of shape "
                    f"{tuple(parameter.shape)}: the file is corrupt or made for another model."
                )
            if not torch.isfinite(value).all():
                raise ValueError(f"{where} holds NaN or inf: the file is corrupt. Save or download the adapter again.")


def check_loaded_graft(model: nn.Module, adapter_name: str) -> None:
    """Check the tensors a graft's layers hold, when its file cannot be read again (transformers' ``load_adapter``
    of a Hub adapter copies the file into the layers itself)."""
    config = model.peft_config[adapter_name]
    layers = {n: m for n, m in model.named_modules() if isinstance(m, GraftLayer)}

    def tensor(module: str, name: str) -> torch.Tensor | None:
        tensors = getattr(layers[module], name)
        return tensors[adapter_name] if adapter_name in tensors else None  # noqa: SIM401 (BufferDict has no get)

    check_graft_tensors(config, layers, tensor)


def _check_saved_whole(config: GraftConfig, adapter_name: str, targets) -> None:
    """A loaded graft's ``modules_to_save`` may not hold a module it grafts (peft would fail wrapping a graft layer)."""
    clash = sorted(key for key in targets if saved_whole_module(key, config.modules_to_save) is not None)
    if clash:
        raise ValueError(
            f"{config.source} (adapter {adapter_name!r}) lists modules_to_save={config.modules_to_save}, but the "
            f"graft grafts module {clash[0]!r} (its entries, or a tensor tied to them): a module is stored whole "
            "or grafted, not both. The config was altered: save or download the adapter again."
        )


def _check_no_graft_layer_stored_whole(model: nn.Module, config: GraftConfig, adapter_name: str) -> None:
    """Refuse a graft that stores whole (``modules_to_save``) a module where other grafts already graft entries: peft
    would copy their graft layer into the stored module, which no graft could then save, load or merge."""
    for name, layer in model.named_modules():
        whole = saved_whole_module(name, config.modules_to_save) if isinstance(layer, GraftLayer) else None
        if whole is None:
            continue
        others = [n for n in layer._all_available_adapter_names() if n != adapter_name]
        raise ValueError(
            f"Adapter {adapter_name!r} stores module {whole!r} whole (modules_to_save={config.modules_to_save}), "
            f"but adapter(s) {others} of this model graft entries of {name!r} in it: in one model a module is "
            f"either stored whole or grafted. Make every graft with {whole!r} in its modules_to_save (then none "
            "grafts entries there), or load these grafts onto separate copies of the base model."
        )


def _check_modules_to_save_not_nested(model: nn.Module, config: GraftConfig, adapter_name: str) -> None:
    """Refuse ``modules_to_save`` entries that resolve to nested modules (``["pooler", "pooler.dense"]``), also with a
    module another adapter stores whole: peft would wrap the inner module inside the outer one's wrapper and save it
    under names its loader cannot find, so the save would write a graft that ``from_pretrained`` refuses."""
    entries = list(config.modules_to_save or ())
    if not entries:
        return
    names = {peft_free_name(name) for name, _ in model.named_modules() if name}
    chosen = {name: next(e for e in entries if name.endswith(e)) for name in names if any(map(name.endswith, entries))}
    others = {
        peft_free_name(name): sorted(set(module._adapters) - {adapter_name})
        for name, module in model.named_modules()
        if isinstance(module, AuxiliaryTrainingWrapper) and set(module._adapters) - {adapter_name}
    }
    added = " (peft adds 'classifier' and 'score' for task_type='SEQ_CLS')" if config.task_type else ""
    for inner in sorted(chosen):
        outer = next((o for o in sorted(chosen) if inner.startswith(f"{o}.")), None)
        if outer is not None:
            raise ValueError(
                f"Adapter {adapter_name!r}: modules_to_save={entries}{added} names module {inner!r} (entry "
                f"{chosen[inner]!r}) inside module {outer!r} (entry {chosen[outer]!r}), which is stored whole with "
                f"everything in it: peft would store {inner!r} twice, and the save would not load. List only "
                f"{chosen[outer]!r}."
            )
        other = next((o for o in sorted(others) if inner.startswith(f"{o}.") or o.startswith(f"{inner}.")), None)
        if other is not None:
            raise ValueError(
                f"Adapter {adapter_name!r}: modules_to_save={entries}{added} stores module {inner!r} whole, and "
                f"adapter(s) {others[other]} of this model store {other!r} whole: one lies inside the other, and peft "
                "cannot store nested modules whole (the save would not load). Store the same module whole in every "
                f"graft (e.g. modules_to_save=[{other!r}]), or use separate copies of the base model."
            )


def check_zero3_forward(layers: list[GraftLayer]) -> None:
    """A graft model runs under DeepSpeed ZeRO-3 only as ``MaskTrainer`` prepares it: the tensors of every graft layer
    registered as its external parameters (ZeRO-3 then gathers its base tensors and S for its forward, which reads
    them itself, not through its base layer's forward), every one partitioned by the engine (a region hardened
    afterwards is not)."""
    for layer in layers:
        if any(not is_partitioned(param) for param in layer.parameters()):
            raise ValueError(
                "A graft model's forward cannot run under DeepSpeed ZeRO-3 once its region was hardened after the "
                "engine partitioned the model (the hard region is not partitioned): save it (trainer.save_model(), "
                "on every process) and load it with PeftModel.from_pretrained in one process, under DDP or under "
                "FSDP2 to evaluate or serve it. See docs/fsdp.md."
            )
        registered = getattr(layer, "_external_params", {})
        if any(id(param) not in registered for param in layer.parameters()):
            raise deepspeed_refusal(
                "A graft model's forward outside MaskTrainer", "DeepSpeed ZeRO-3", ZERO3_FORWARD_WAY_OUT
            )


ZERO3_FORWARD_WAY_OUT = (
    "under ZeRO-3 peft_graft runs a graft model's forward only while MaskTrainer learns a region "
    "(TrainingArguments(deepspeed=<ZeRO-3 config>)), which registers the tensors of every graft layer with ZeRO-3 "
    "before DeepSpeed wraps the model. Evaluate or serve a graft in one process, under DDP or under FSDP2. See "
    "docs/fsdp.md."
)


def check_adapter_name(name: object) -> None:
    """Adapter names become folder names when saving and keys of module buffers: refuse what cannot be either."""
    if not isinstance(name, str) or not name.strip() or any(c in name for c in "./\\:\0") or name == BASE:
        raise ValueError(
            f"adapter_name={name!r} cannot name a graft: it becomes a sub-folder of the save directory and a key of "
            "the graft layers' buffers. Use a non-empty name without '.', '/', '\\', ':' (e.g. 'sentiment_v2'); "
            "'__base__' names the pre-trained model in mixed batches (adapter_names)."
        )


def validate_entries(
    indices: torch.Tensor, values: torch.Tensor, count: int, size: int, module: str, what: str = "graft entries"
) -> None:
    """Raise a clear error for entries that do not fit their module: int32/int64 indices into ``[0, size)``, strictly
    increasing, and ``count`` finite fp32 values (no silent cast from another dtype)."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"Module {module!r}: {what} have index dtype {indices.dtype}; expected int32 or int64.")
    if values.dtype != torch.float32:
        raise ValueError(
            f"Module {module!r}: {what} have value dtype {values.dtype}; graft values are float32. The file was not "
            "written by peft_graft, or was altered: save the graft again."
        )
    if indices.shape != (count,) or values.shape != (count,):
        raise ValueError(
            f"Module {module!r}: the adapter config records {count} {what} but the file holds "
            f"{tuple(indices.shape)} indices and {tuple(values.shape)} values: config and weights do not match."
        )
    if count and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise ValueError(f"Module {module!r}: {what} fall outside [0, {size}): the file is corrupt.")
    if count > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"Module {module!r}: {what} are not strictly increasing: the file is corrupt.")
    if not torch.isfinite(values).all():
        raise ValueError(f"Module {module!r}: {what} contain NaN or inf values: the file is corrupt.")


def _exact_after_combining(
    stacked: torch.Tensor, exact: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The combined entries to store exactly: those whose combined value is one graft's own delta where that graft
    stores theta_ft exactly (a single graft there, or the one ``"first"``/``"last"`` picked)."""
    picked = (stacked == values) & ~torch.isnan(exact)
    if not picked.any():
        return NO_ENTRIES
    row = picked.float().argmax(0)
    columns = picked.any(0).nonzero().reshape(-1)
    return indices[columns], exact[row[columns], columns]


def _combined_heads(
    model: nn.Module, adapter_names: list[str], combination
) -> list[tuple[ModulesToSaveWrapper, dict[str, torch.Tensor]]]:
    """Per ``modules_to_save`` wrapper holding a copy for any of ``adapter_names``: its parameters combined by
    ``combination`` over the grafts (the base module's where a graft has no copy)."""
    out = []
    for wrapper in model.modules():
        if not isinstance(wrapper, ModulesToSaveWrapper) or not any(
            n in wrapper.modules_to_save for n in adapter_names
        ):
            continue
        sources = [
            wrapper.modules_to_save[n] if n in wrapper.modules_to_save else wrapper.original_module  # noqa: SIM401
            for n in adapter_names
        ]
        tensors = {}
        for name, param in wrapper.original_module.named_parameters():
            stacked = torch.stack([source.get_parameter(name).detach().float().reshape(-1).cpu() for source in sources])
            tensors[name] = _combine(stacked, combination).reshape(param.shape)
        out.append((wrapper, tensors))
    return out


def _combine(stacked: torch.Tensor, combination) -> torch.Tensor:
    present = ~torch.isnan(stacked)
    if callable(combination):
        combined = combination(stacked)
        if not isinstance(combined, torch.Tensor) or combined.shape != stacked.shape[1:]:
            shape = tuple(combined.shape) if isinstance(combined, torch.Tensor) else type(combined).__name__
            raise ValueError(
                f"combination must map a (num_grafts, n) tensor to an (n,) tensor; it returned {shape} for "
                f"{tuple(stacked.shape)} (NaN marks a graft without that entry)."
            )
        if not bool(torch.isfinite(combined).all()):
            raise ValueError(f"combination returned NaN or inf for {tuple(stacked.shape)} values.")
        return combined.float()
    if combination == "sum":
        return torch.nansum(stacked, 0)
    if combination == "average":
        return torch.nansum(stacked, 0) / present.sum(0)
    rows = (
        present.float().argmax(0)
        if combination == "first"
        else stacked.shape[0] - 1 - present.flip(0).float().argmax(0)
    )
    return stacked.gather(0, rows.unsqueeze(0)).squeeze(0)


def _record_layout(model: nn.Module, config: GraftConfig, adapter_name: str) -> None:
    """Store the per-module entry counts and base fingerprint and checksum of an adapter in its config (needed to load
    it). A hard region keeps what was recorded from theta_pre when it was set, so saving while merged records theta_pre,
    not the merged values."""
    counts, fingerprints, checksums, exact = {}, {}, {}, {}
    for name, module in model.named_modules():
        if isinstance(module, GraftLayer):
            indices, _ = module.entries(adapter_name)
            if indices.numel():
                key = name.removeprefix(PEFT_PREFIX)
                counts[key] = int(indices.numel())
                num_exact = int(module.exact_entries(adapter_name, indices)[0].numel())
                if num_exact:
                    exact[key] = num_exact
                if module.has_region(adapter_name) and not module.is_learning(adapter_name):
                    fingerprint, checksum, _ = module.base_records(adapter_name)
                else:
                    fingerprint, checksum = module.base_values(indices[:2]).tolist(), module.base_checksum(indices)
                fingerprints[key] = fingerprint
                if checksum:
                    checksums[key] = checksum
    config.grafted_modules, config.base_fingerprint, config.base_checksum = counts, fingerprints, checksums
    config.exact_entries = exact
    config._intern_module_names()  # one copy of each module name, shared by every graft's config (issue 28)


def _creation_provenance(plan: Plan, config: GraftConfig, model: nn.Module) -> dict:
    """The provenance of a graft just created from ``plan`` (see :mod:`.provenance`)."""
    search = None
    if plan.learning and all(learning.search_indices is not None for learning in plan.learning.values()):
        search = sum(int(learning.search_indices.numel()) for learning in plan.learning.values())
    start = sum(int(indices.numel()) for indices, _ in plan.regions.values())
    num_parameters = num_base_parameters(model)
    return provenance.chosen(config.region, start, plan.num_eligible, num_parameters, bool(plan.learning), search)


def _modules_to_save_tensor(model: nn.Module, name: str, adapter_name: str) -> nn.Parameter | None:
    """The trainable copy, inside its ModulesToSaveWrapper, of the base model tensor ``name``."""
    parts, module = name.split("."), model
    for cut, part in enumerate(parts[:-1], 1):
        module = module._modules.get(part)
        if module is None:
            return None
        if isinstance(module, ModulesToSaveWrapper):
            copies = module.modules_to_save
            return copies[adapter_name].get_parameter(".".join(parts[cut:])) if adapter_name in copies else None
    return None
