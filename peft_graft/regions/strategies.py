"""Region strategies: the ways to choose a graft's region, as functions registered by name.

``GraftConfig(region=NAME)`` picks one. A strategy receives a :class:`RegionRequest` (the movement of every eligible
tensor, the budget rule, the model's parameter layout, the seed and the user's ``given_region``) and returns a
:class:`Region` over eligible tensors. Built in: ``"movement"`` (the paper's ``gamma_base``), ``"random"``,
``"bias"``, ``"fisher"`` (a FISH mask), ``"given"`` and ``"empty"``. A new strategy is one function::

    @register_region_strategy("largest_relative")
    def largest_relative(request: RegionRequest) -> Region:
        ratios = {n: d.abs() / (request.pretrained(n).abs() + 1e-8) for n, d in request.movement.items()}
        return global_top_k(ratios, request.budget(request.num_eligible))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..parameter_layout import Layout
from .region import Region, saved_region
from .selection import global_top_k, random_region, top_k_movement

RegionStrategyFn = Callable[["RegionRequest"], Region]


@dataclass(frozen=True)
class RegionRequest:
    """What a region strategy is given.

    Attributes:
        movement: ``theta_ft - theta_pre`` (fp32) of every eligible tensor, by parameter name: a mapping that computes
            each tensor when it is read (:class:`peft_graft.scores.movement.Movement`), so read it tensor by tensor
            rather than keeping them all, or piece by piece (:func:`peft_graft.regions.selection.flat_pieces`, which
            :func:`~peft_graft.regions.global_top_k` uses) to never hold a whole tensor. Sizes: :meth:`numel`.
        budget: ``budget(n)`` is the number of entries to choose among ``n`` eligible ones (``GraftConfig.sparsity``
            or ``num_entries``); it raises a clear error when the budget cannot be met.
        layout: Where each parameter tensor of the pre-trained model lives (see :mod:`peft_graft.parameter_layout`).
        seed: ``GraftConfig.seed``.
        given: ``GraftConfig(given_region=...)``, as the user passed it.
        scores: ``GraftConfig(region_scores=...)``, as the user passed it (e.g. a Fisher diagonal).
        top_movement: The top entries of ``|movement|`` when the caller has chosen them already (a learned region's
            search space, ``GraftConfig.search_fraction``), else ``None``: pass it as ``within`` to
            :func:`~peft_graft.regions.top_k_movement` for a top-k of at most that many entries.
    """

    movement: Mapping[str, torch.Tensor]
    budget: Callable[[int], int]
    layout: Layout
    seed: int = 0
    given: Any = None
    scores: Any = None
    top_movement: Region | None = None

    @property
    def num_eligible(self) -> int:
        """Number of eligible entries."""
        return sum(self.numel(name) for name in self.movement)

    def numel(self, name: str) -> int:
        """Number of entries of tensor ``name`` (without computing its movement)."""
        return self.layout.tensors[name].parameter.numel()

    def pretrained(self, name: str) -> torch.Tensor:
        """theta_pre of tensor ``name``."""
        return self.layout.tensors[name].parameter.detach()


@dataclass(frozen=True)
class RegionStrategy:
    """A registered strategy: its function and whether it uses the size budget (``sparsity``/``num_entries``)."""

    name: str
    fn: RegionStrategyFn
    uses_budget: bool = True


REGION_STRATEGIES: dict[str, RegionStrategy] = {}
"""Registered strategies by name (read it; add with :func:`register_region_strategy`)."""


def register_region_strategy(
    name: str, fn: RegionStrategyFn | None = None, *, uses_budget: bool = True, overwrite: bool = False
):
    """Register ``fn`` as ``GraftConfig(region=name)``; usable as a decorator. Returns ``fn``.

    ``uses_budget=False`` for strategies whose size is not ``sparsity``/``num_entries`` (e.g. a given region).
    Registering a taken name raises unless ``overwrite=True``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"A region strategy needs a non-empty name, got {name!r}.")

    def register(function: RegionStrategyFn) -> RegionStrategyFn:
        if not callable(function):
            raise TypeError(f"Region strategy {name!r} must be a function of a RegionRequest, got {function!r}.")
        if name in REGION_STRATEGIES and not overwrite:
            raise ValueError(f"A region strategy named {name!r} exists already: pass overwrite=True to replace it.")
        REGION_STRATEGIES[name] = RegionStrategy(name, function, uses_budget)
        return function

    return register if fn is None else register(fn)


def get_region_strategy(name: str) -> RegionStrategy:
    """The strategy registered as ``name``, or a ``ValueError`` listing the registered ones."""
    if name not in REGION_STRATEGIES:
        raise ValueError(
            f"Unknown region strategy region={name!r}: use one of {tuple(REGION_STRATEGIES)}, or register yours with "
            "peft_graft.register_region_strategy."
        )
    return REGION_STRATEGIES[name]


def choose_region(name: str, request: RegionRequest) -> Region:
    """Run strategy ``name`` and check that its region covers eligible entries only."""
    region = get_region_strategy(name).fn(request)
    if not isinstance(region, Region):
        raise TypeError(f"Region strategy {name!r} returned {type(region).__name__}, not a Region.")
    for tensor, indices in region.items():
        if tensor not in request.movement:
            raise ValueError(
                f"Region strategy {name!r} chose entries of {tensor!r}, which is not an eligible tensor that "
                "fine-tuning moved."
            )
        if int(indices.max()) >= request.numel(tensor):
            raise ValueError(f"Region strategy {name!r} indexes {tensor!r} beyond its {request.numel(tensor)} entries.")
    return region


@register_region_strategy("movement")
def movement_region(request: RegionRequest) -> Region:
    """The paper's ``gamma_base``: the top-k entries of ``|theta_ft - theta_pre|`` over all eligible tensors."""
    return top_k_movement(request.movement, request.budget(request.num_eligible), within=request.top_movement)


@register_region_strategy("random")
def random_entries(request: RegionRequest) -> Region:
    """k eligible entries drawn uniformly at random (seeded by ``GraftConfig.seed``)."""
    sizes = {name: request.numel(name) for name in request.movement}
    return random_region(sizes, request.budget(request.num_eligible), request.seed)


@register_region_strategy("bias")
def bias_region(request: RegionRequest) -> Region:
    """The top-k movement entries among biases only (paper Figure 4a)."""
    biases = {n: request.movement[n] for n in request.movement if request.layout.tensors[n].attr == "bias"}
    if not biases:
        raise ValueError('region="bias" but no eligible bias moved during fine-tuning.')
    return top_k_movement(biases, request.budget(sum(d.numel() for d in biases.values())))


@register_region_strategy("fisher")
def fisher_region(request: RegionRequest) -> Region:
    """A FISH mask (Sung et al. 2021; grafting paper Table 8): the top-k eligible entries by
    ``GraftConfig(region_scores=...)``, e.g. the Fisher diagonal of theta_pre from
    :func:`peft_graft.scores.fisher_diagonal`. k is the same budget as the other strategies' (of all eligible
    entries); eligible tensors without a score are left out. Scores are looked up under any name of a tied tensor."""
    if not isinstance(request.scores, Mapping):
        raise TypeError(
            'region="fisher" needs region_scores: a dict of score tensors by parameter name (e.g. '
            f"peft_graft.scores.fisher_diagonal(model, dataset)), got {type(request.scores).__name__}."
        )
    scores = {}
    for name in request.movement:
        alias = next((a for a in request.layout.tensors[name].aliases if a in request.scores), None)
        if alias is None:
            continue
        score, shape = request.scores[alias], tuple(request.pretrained(name).shape)
        if not isinstance(score, torch.Tensor) or tuple(score.shape) != shape:
            raise ValueError(
                f"region_scores[{alias!r}] must be a tensor of the parameter's shape {shape}, got "
                f"{tuple(getattr(score, 'shape', ())) or type(score).__name__}."
            )
        if not bool(torch.isfinite(score).all()) or bool((score < 0).any()):
            raise ValueError(
                f"region_scores[{alias!r}] holds negative or non-finite values: a Fisher diagonal is finite and >= 0."
            )
        scores[name] = score
    if not scores:
        raise ValueError(
            "region_scores names none of the eligible tensors: score the model's parameters by their names in "
            "model.named_parameters() (fisher_diagonal does)."
        )
    k = request.budget(request.num_eligible)
    scored = sum(s.numel() for s in scores.values())
    if k > scored:
        raise ValueError(f"The budget asks for {k} entries but region_scores covers only {scored} eligible ones.")
    return global_top_k(scores, k)


@register_region_strategy("given", uses_budget=False)
def given_region(request: RegionRequest) -> Region:
    """``GraftConfig(given_region=...)``: boolean masks by parameter name, a :class:`Region` or a saved graft's path."""
    given = request.given
    if isinstance(given, (str, os.PathLike)):
        given = saved_region(given, request.layout)
    elif isinstance(given, Mapping) and not isinstance(given, Region):
        for name, mask in given.items():
            info = request.layout.tensors.get(name)
            shape = getattr(mask, "shape", None)
            if info is not None and shape is not None and tuple(shape) != tuple(info.parameter.shape):
                raise ValueError(
                    f"given_region mask {name!r} has shape {tuple(shape)} but the parameter has shape "
                    f"{tuple(info.parameter.shape)}: pass a mask of the parameter's own shape."
                )
        given = Region.from_masks(given)
    if not isinstance(given, Region):
        raise TypeError(f"given_region must be masks, a Region or a saved graft path, got {type(given).__name__}.")
    if given.num_entries == 0:
        raise ValueError("The given region is empty.")
    return given


@register_region_strategy("empty", uses_budget=False)
def empty_region(request: RegionRequest) -> Region:
    """No entry (``gamma_base = 0``): a region learned from scratch by ``MaskTrainer``."""
    return Region()
