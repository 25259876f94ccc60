"""Planning: what injecting one graft adapter does to each module, decided before peft walks the model.

A pure stage: it reads the pre-trained model's structure and values, theta_ft and the config, and returns a
:class:`Plan`; it changes nothing. ``theta_ft -> movement -> region (strategy) -> per-module entries`` for a new graft,
or the saved per-module entry counts for a loaded one.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn

from ..parameter_layout import NO_ENTRIES, Layout, peft_free_name
from ..regions import Region, RegionRequest, choose_region, top_k_movement
from ..scores.checkpoint import StreamedCheckpoint
from ..scores.movement import (
    Movement,
    eligible_tensors,
    exact_movement,
    finetuned_pieces,
    finetuned_tensor,
    is_saved_whole,
    load_finetuned,
)
from .config import GraftConfig


@dataclass
class LearningPlan:
    """The state to learn a module's region: movement, ``gamma_base`` positions in it, and the search space.

    Dense (``search_indices=None``): ``movement`` covers the module's whole flat index space and ``base_region`` holds
    flat indices. Otherwise ``movement`` covers the sorted flat ``search_indices`` only and ``base_region`` holds
    positions among them.
    """

    movement: torch.Tensor
    base_region: torch.Tensor
    search_indices: torch.Tensor | None = None
    unreachable: tuple[torch.Tensor, torch.Tensor] = NO_ENTRIES  # (sorted flat indices, theta_ft): see Plan


@dataclass
class Plan:
    """What injecting one adapter does, per module (names relative to the base model)."""

    layout: Layout
    targets: set[str] = field(default_factory=set)  # modules to wrap: storage modules and users of tied tensors
    entries: dict[str, int] = field(default_factory=dict)  # storage module -> number of grafted entries
    regions: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # module -> (indices, values)
    # module -> (sorted flat indices, theta_ft as fp32) of the entries no fp32 delta reproduces (scores.exact_delta)
    unreachable: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    learning: dict[str, LearningPlan] = field(default_factory=dict)  # modules whose region is learned
    saved_whole: dict[str, torch.Tensor] = field(default_factory=dict)  # theta_ft of modules_to_save tensors
    num_eligible: int = 0  # entries the region was chosen among (the denominator of GraftConfig.sparsity)


def plan_loaded_graft(config: GraftConfig, layout: Layout, model: nn.Module, adapter_name: str) -> Plan:
    """Empty hard regions of the recorded sizes, to be filled by loading the saved entries."""
    unknown = sorted(set(config.grafted_modules) - set(layout.stored))
    wrapped = _wrapped_modules(model) if unknown else {}
    for module in unknown:
        whole = next((w for w in wrapped if module == w or module.startswith(f"{w}.")), None)
        if whole is not None:
            raise ValueError(
                f"Graft {adapter_name!r} ({config.source}) grafts entries of module {module!r}, but this model "
                f"stores {whole!r} whole (modules_to_save) for adapter(s) {wrapped[whole]}: in one model a module is "
                f"either stored whole or grafted. Make every graft with {whole!r} in its modules_to_save (a task head "
                "fine-tuning changed must be stored whole), or load these grafts onto separate copies of the base "
                "model."
            )
    if unknown:
        raise ValueError(
            f"This graft was made for another architecture: modules {unknown[:5]} hold no parameter of this model."
        )
    return Plan(layout, layout.application_modules(set(config.grafted_modules)), dict(config.grafted_modules))


def plan_new_graft(model: nn.Module, config: GraftConfig, layout: Layout) -> Plan:
    """A new graft: theta_ft -> movement -> region (``config.region`` strategy) -> per-module entries."""
    if config._finetuned is None:
        raise ValueError(
            "GraftConfig needs finetuned=<model, path, Hub id or state dict> to create a graft. A config read from a "
            "saved graft must record its grafted_modules (entries per module); this one records none, so its "
            "adapter_config.json is incomplete or not a graft's: save the graft again."
        )
    state = load_finetuned(config._finetuned, model)
    _warn_unknown_tensors(state, model, layout)
    eligible = eligible_tensors(layout, config.include_parameters, config.exclude_parameters, config.modules_to_save)
    movement, unreachable = exact_movement(state, layout, eligible, config.only_moved)
    if not movement:
        raise ValueError("No eligible tensor moved during fine-tuning: check finetuned and the parameter filters.")
    search = _top_of_search_space(config, movement, layout)
    request = RegionRequest(
        movement, config.budget, layout, config.seed, config._given_region, config._region_scores, search
    )
    region = choose_region(config.region, request)
    _warn_dropped_heads(state, layout, config, movement, region)
    plan = Plan(layout, num_eligible=request.num_eligible)
    plan.regions = _by_module(layout, {n: (idx, movement.gather(n, idx)) for n, idx in region.items()})
    plan.unreachable = _by_module(layout, unreachable)
    if search is not None:
        _plan_search_space(plan, movement, search | region)
    elif config.learn_region:
        _plan_dense_learning(plan, movement)
    plan.entries = {m: int(idx.numel()) for m, (idx, _) in plan.regions.items()}
    plan.targets = layout.application_modules(set(plan.regions))
    for name, info in layout.tensors.items():  # whole tensors of modules_to_save (e.g. a new head)
        saved_whole = any(is_saved_whole(alias, config.modules_to_save) for alias in info.aliases)
        if info.parameter.is_floating_point() and name not in movement and saved_whole:
            plan.saved_whole[name] = _finite(finetuned_tensor(state, layout, name), name)
    for name, parameter in _wrapped_whole_tensors(model).items():  # heads peft wrapped for an earlier adapter
        if parameter.is_floating_point() and is_saved_whole(name, config.modules_to_save):
            tensor = state.get(name)
            if not torch.is_tensor(tensor) or tuple(tensor.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"The fine-tuned model has no tensor {name!r} of shape {tuple(parameter.shape)} to store whole "
                    "(modules_to_save): is it fine-tuned from this pre-trained model?"
                )
            if not tensor.is_floating_point():
                raise TypeError(f"theta_ft of {name!r} is not floating point (theta_pre is {parameter.dtype}).")
            plan.saved_whole[name] = _finite(tensor, name)
    if isinstance(state, StreamedCheckpoint):
        state.close()  # unmap the last shard now rather than when the mapping is collected
    return plan


def _finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` (theta_ft of a tensor stored whole), refused if it holds NaN or inf."""
    if not torch.isfinite(tensor).all():
        raise ValueError(f"theta_ft of {name!r} (stored whole, modules_to_save) has NaN or inf entries.")
    return tensor


def _wrapped_modules(model: nn.Module) -> dict[str, list[str]]:
    """The modules peft already stores whole (``modules_to_save``), by their names in the plain model, and the
    adapters holding a copy of each."""
    return {
        peft_free_name(name): sorted(module._adapters)
        for name, module in model.named_modules()
        if isinstance(module, AuxiliaryTrainingWrapper)
    }


def _wrapped_whole_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of modules peft already wraps as modules_to_save (for an earlier adapter), which the layout skips,
    by their names in the plain model."""
    out = {}
    for name, module in model.named_modules():
        original = getattr(module, "original_module", None)
        if isinstance(module, AuxiliaryTrainingWrapper) and original is not None:
            for attr, parameter in original.named_parameters():
                out[f"{peft_free_name(name)}.{attr}"] = parameter
    return out


def _plan_dense_learning(plan: Plan, movement: Mapping[str, torch.Tensor]) -> None:
    """The paper's search space: S over every entry of each module holding a moved tensor (the movement of every
    eligible tensor is kept: a full fp32 copy, which the search space avoids)."""
    layout = plan.layout
    for module in {layout.tensors[name].module for name in movement}:
        flat = [
            movement[info.name].reshape(-1) if info.name in movement else torch.zeros(info.parameter.numel())
            for info in (layout.by_site[(module, attr)] for attr in layout.stored[module])
        ]
        base = plan.regions.get(module, NO_ENTRIES)[0]
        plan.learning[module] = LearningPlan(torch.cat(flat), base, None, plan.unreachable.get(module, NO_ENTRIES))
        plan.regions.setdefault(module, NO_ENTRIES)


def _top_of_search_space(config: GraftConfig, movement: Movement, layout: Layout) -> Region | None:
    """The top movement entries (``search_fraction``/``search_entries``) a learned region's search space starts from,
    or ``None`` when S covers every entry or nothing is learned. Chosen before the region, which the ``movement``
    strategy then picks among them (``RegionRequest.top_movement``) rather than by passes over every entry."""
    if not (config.learn_region and config.searches_subset):
        return None
    size = config.search_space_size(sum(layout.tensors[name].parameter.numel() for name in movement))
    search = top_k_movement(movement, size)
    movement.keep_gathered = True  # the region and the values are read among its entries: read theta_ft there once
    return search


def _plan_search_space(plan: Plan, movement: Movement, chosen: Region) -> None:
    """S on the search space only: ``chosen``, the top movement entries (``search_fraction``/``search_entries``)
    plus the region."""
    layout = plan.layout
    values = {name: movement.gather(name, chosen[name]) for name in movement if name in chosen}
    for module in sorted({layout.tensors[name].module for name in chosen}):
        space = layout.index_space(module)
        names = [layout.by_site[(module, attr)].name for attr in layout.stored[module]]
        names = [name for name in names if name in chosen]
        search = torch.cat([chosen[n] + space.start(layout.tensors[n].attr) for n in names])  # sorted: offset order
        base = plan.regions.get(module, NO_ENTRIES)[0]
        plan.learning[module] = LearningPlan(
            torch.cat([values[n] for n in names]),
            torch.searchsorted(search, base.to(torch.int64)),
            search,
            plan.unreachable.get(module, NO_ENTRIES),
        )
        plan.regions.setdefault(module, NO_ENTRIES)


def _by_module(
    layout: Layout, per_tensor: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Tensor name -> (local flat indices, values) as storage module -> (sorted flat indices of its space, values)."""
    pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, (local, values) in per_tensor.items():
        info = layout.tensors[name]
        start = layout.index_space(info.module).start(info.attr)
        pieces.setdefault(info.module, []).append((local + start, values))
    out = {}
    for module, parts in pieces.items():
        indices, values = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        order = indices.argsort()
        out[module] = (indices[order], values[order])
    return out


HEAD_MODULES = ("classifier", "score", "qa_outputs")
"""Names of the task heads transformers adds on top of a pre-trained model (peft stores them whole for SEQ_CLS,
TOKEN_CLS and QUESTION_ANS): new layers, random in theta_pre."""


def _warn_dropped_heads(state, layout: Layout, config: GraftConfig, movement: Movement, region: Region) -> None:
    """Warn when theta_ft's task head differs from theta_pre's but the graft would not carry it over: the head is not
    stored whole (``modules_to_save``) and the region holds only part of its moved entries (none when filters make it
    ineligible). The grafted model would then run with the pre-trained head, random for a head added by fine-tuning."""
    dropped: dict[str, tuple[int, int]] = {}  # head module -> (moved entries, entries in the region)
    for name, info in layout.tensors.items():
        head = _head_module(info.aliases)
        if head is None or not info.parameter.is_floating_point():
            continue
        if any(is_saved_whole(alias, config.modules_to_save) for alias in info.aliases):
            continue
        if name in movement:
            moved = sum(int(piece.count_nonzero()) for _, piece in movement.pieces(name))
        else:  # ineligible (filters): did fine-tuning move it? (a tensor theta_ft lacks or shapes otherwise: skipped)
            try:
                pieces = finetuned_pieces(state, layout, name)
                moved = sum(int((pre != ft.to(pre.dtype)).sum()) for _, pre, ft in pieces)
            except (KeyError, ValueError, TypeError):
                continue
        kept = int(region[name].numel()) if name in region else 0
        if moved > kept:
            total_moved, total_kept = dropped.get(head, (0, 0))
            dropped[head] = (total_moved + moved, total_kept + kept)
    if not dropped:
        return
    heads = sorted({head.rpartition(".")[2] for head in dropped})
    task = "QUESTION_ANS" if heads == ["qa_outputs"] else "SEQ_CLS"  # peft's task types that store these heads
    details = "; ".join(f"{head!r}: {kept} of its {moved} moved entries" for head, (moved, kept) in dropped.items())
    warnings.warn(
        f"theta_ft's task head differs from theta_pre's, but the graft keeps only part of it ({details}): the grafted "
        "model would run with the pre-trained head, which is random for a head added by fine-tuning (outputs near "
        f"chance). Store the head whole: GraftConfig(..., modules_to_save={heads!r}), or task_type={task!r} (peft then "
        "stores it whole).",
        UserWarning,
        stacklevel=4,
    )


def _head_module(aliases: tuple[str, ...]) -> str | None:
    """The task head module (:data:`HEAD_MODULES`) a tensor belongs to, by any of its names, or ``None``."""
    for alias in aliases:
        parts = alias.split(".")[:-1]
        for position, part in enumerate(parts):
            if part in HEAD_MODULES:
                return ".".join(parts[: position + 1])
    return None


def _warn_unknown_tensors(state, model: nn.Module, layout: Layout) -> None:
    """Warn when theta_ft holds floating-point tensors the pre-trained model lacks (e.g. extra layers): those are
    ignored, and the two models are probably not a pre-trained model and its own fine-tune."""
    known = {alias for info in layout.tensors.values() for alias in info.aliases}
    known |= set(model.state_dict())
    known |= {peft_free_name(name) for name in known}
    unknown = sorted(name for name in state if peft_free_name(name) not in known and _is_floating_tensor(state, name))
    if unknown:
        warnings.warn(
            f"The fine-tuned model holds {len(unknown)} tensors the pre-trained model lacks (e.g. {unknown[:3]}); they "
            "are ignored. Is theta_ft fine-tuned from this very pre-trained model, with the same architecture?",
            UserWarning,
            stacklevel=4,
        )


def _is_floating_tensor(state: Mapping[str, torch.Tensor], name: str) -> bool:
    """Whether ``state[name]`` is a floating-point tensor, read from the file header for a streamed checkpoint."""
    if isinstance(state, StreamedCheckpoint):
        return state.is_floating_point(name)
    tensor = state[name]
    return torch.is_tensor(tensor) and tensor.is_floating_point()
