"""Multi-task regions (paper section 5.1, Figure 8): overlap, relative gain, unions of regions and "purify" steps.

Given task-specific regions ``gamma_i`` (each learned on the multi-task model, e.g. ``graft.get_region()`` of a graft
per task), this module computes the asymmetric overlap matrix (Fig. 8a), the relative performance gain of Eq. 5 for
each region on each task (Fig. 8b-d), the union ``gamma_G`` of a group of tasks (Fig. 8c), a few gradient steps on the
joint loss of a group inside its union (Fig. 8d, "purify"), and an annotated heatmap of any of these matrices.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import nn
from tqdm.auto import tqdm

from ..calibration.plots import DEFAULT_DPI, _new_figure
from ..parameter_layout import PEFT_PREFIX, peft_free_name
from ..regions.region import Region
from ..training.restriction import restrict_training

__all__ = [
    "DEFAULT_PURIFY_LEARNING_RATE",
    "group_regions",
    "overlap_matrix",
    "plot_region_matrix",
    "purify",
    "relative_gain",
    "relative_gain_matrix",
]

DEFAULT_PURIFY_LEARNING_RATE = 1e-2
"""The largest learning rate of the paper's SGD fine-tuning grid {1e-2, 5e-3, 1e-3} (Appendix A.2)."""


def _checked_regions(regions: Mapping[str, Region], what: str = "regions") -> None:
    if not isinstance(regions, Mapping):
        raise TypeError(f"{what} must be a mapping of task name -> Region, got {type(regions).__name__}.")
    if not regions:
        raise ValueError(f"{what} is empty: give at least one task's region.")
    for task, region in regions.items():
        if not isinstance(region, Region):
            raise TypeError(f"The region of task {task!r} must be a Region, got {type(region).__name__}.")


def overlap_matrix(regions: Mapping[str, Region]) -> torch.Tensor:
    """The asymmetric overlap of paper Figure 8a: ``M[i, j] = |g_i & g_j| / |g_j|`` (float64, ``n x n``).

    Rows and columns follow the order of ``regions`` (task name -> region); ``M[i, j]`` equals
    ``regions[i].overlap(regions[j])`` and the diagonal is 1. An empty region is a ``ValueError`` naming its task.
    """
    _checked_regions(regions)
    names, values = list(regions), list(regions.values())
    for task, region in regions.items():
        if region.num_entries == 0:
            raise ValueError(f"The region of task {task!r} is empty: its overlap |g_i & g_j| / |g_j| is undefined.")
    sizes = torch.tensor([r.num_entries for r in values], dtype=torch.float64)
    common = torch.zeros(len(names), len(names), dtype=torch.float64)
    for i, region in enumerate(values):
        common[i, i] = sizes[i]
        for j in range(i + 1, len(values)):
            common[i, j] = common[j, i] = (region & values[j]).num_entries
    return common / sizes.unsqueeze(0)


def relative_gain(grafted: float, pretrained: float, full: float, task: str | None = None) -> float:
    """Paper Eq. 5: ``(P_graft - P_pre) / (P_full - P_pre)``, the share of the full model's gain a graft recovers.

    ``full`` is the score of the model the region was grafted from (the multi-task model in section 5.1). Undefined,
    hence a ``ValueError``, when ``full == pretrained`` or a score is not finite; ``task`` names it in the message.
    """
    about = f" of task {task!r}" if task is not None else ""
    scores = {}
    for field, value in (("grafted", grafted), ("pretrained", pretrained), ("full", full)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"The relative gain{about} needs finite real scores: {field} is {value!r}.")
        scores[field] = float(value)
    grafted, pretrained, full = scores["grafted"], scores["pretrained"], scores["full"]
    if full == pretrained:
        raise ValueError(
            f"The relative gain{about} is undefined: the full model's score equals the pre-trained one ({full!r})."
        )
    return (grafted - pretrained) / (full - pretrained)


def group_regions(regions: Mapping[str, Region], groups: Mapping[str, Sequence[str]]) -> dict[str, Region]:
    """The union ``gamma_G`` of the regions of each group's tasks (paper Figure 8c), keyed by group name.

    ``groups`` maps a group name to task names of ``regions``, e.g. ``{"sentiment": ["sst2", "cr"]}``. An unknown
    task or an empty group is a ``ValueError`` naming it.
    """
    _checked_regions(regions)
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError("groups must be a non-empty mapping of group name -> task names.")
    unions = {}
    for group, tasks in groups.items():
        if isinstance(tasks, str) or not isinstance(tasks, Iterable):
            raise TypeError(f"Group {group!r} must be a sequence of task names, got {tasks!r}.")
        tasks = list(tasks)
        if not tasks:
            raise ValueError(f"Group {group!r} is empty: name at least one task.")
        unknown = [t for t in tasks if t not in regions]
        if unknown:
            raise ValueError(f"Group {group!r} names tasks with no region: {unknown}. Known tasks: {list(regions)}.")
        union = Region()
        for task in tasks:
            union = union | regions[task]
        unions[group] = union
    return unions


def relative_gain_matrix(
    regions: Mapping[str, Region],
    tasks: Sequence[str],
    score: Callable[[Region, str], float],
    pretrained: Mapping[str, float],
    full: Mapping[str, float],
    *,
    disable_tqdm: bool = False,
) -> torch.Tensor:
    """Relative gains of Eq. 5 (paper Figure 8b-d): rows = ``regions`` (single tasks or groups), columns = ``tasks``.

    Entry ``[i, j]`` is ``relative_gain(score(region_i, task_j), pretrained[task_j], full[task_j])``. ``score`` is the
    caller's evaluation, e.g. the accuracy on ``task`` of theta_pre with ``region`` grafted from the multi-task model
    (an empty region scores as theta_pre). Every task's ``pretrained`` and ``full`` score is checked before the first
    of the ``len(regions) * len(tasks)`` evaluations, which show a tqdm bar (``disable_tqdm=True`` hides it).
    """
    _checked_regions(regions)
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty sequence of task names, got {tasks!r}.")
    tasks = list(tasks)
    for task in tasks:
        for field, scores in (("pretrained", pretrained), ("full", full)):
            if task not in scores:
                raise ValueError(f"No {field} score for task {task!r}.")
        relative_gain(pretrained[task], pretrained[task], full[task], task=task)  # undefined gains fail up front
    gains = torch.empty(len(regions), len(tasks), dtype=torch.float64)
    with tqdm(total=gains.numel(), desc="relative gain", disable=disable_tqdm) as progress:
        for i, (name, region) in enumerate(regions.items()):
            for j, task in enumerate(tasks):
                value = score(region, task)
                try:
                    gains[i, j] = relative_gain(value, pretrained[task], full[task], task=task)
                except ValueError as error:
                    raise ValueError(f"Region {name!r}: {error}") from None
                progress.update(1)
    return gains


def _cycled(task: str, batches: Iterable[Any]) -> Iterator[Any]:
    """The batches of ``task`` over and over: a re-iterable (list, DataLoader) is iterated again, a one-shot iterator's
    batches are remembered."""
    if isinstance(batches, Iterator):
        seen = []
        for batch in batches:
            seen.append(batch)
            yield batch
        batches = seen
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            raise ValueError(f"Task {task!r} has no batches.")


def purify(
    model: nn.Module,
    region: Region,
    task_batches: Mapping[str, Iterable[Mapping[str, torch.Tensor]]],
    steps: int = 10,
    learning_rate: float = DEFAULT_PURIFY_LEARNING_RATE,
    optimizer: torch.optim.Optimizer | None = None,
) -> list[float]:
    """The paper's "purify" (Figure 8d): a few gradient steps inside ``region`` on the joint loss ``sum_i L_i``.

    Each step takes the next batch of every task in ``task_batches`` (task name -> batches, each iterable cycled),
    backpropagates ``model(**batch).loss`` of each (their sum is the joint loss) and steps under
    ``restrict_training(model, allowed=region)``: no entry outside ``region`` changes, bit for bit.

    Args:
        model: The grafted model, e.g. a graft's ``merge_and_unload()`` (a plain model), or a peft model (regions name
            parameters as the plain model does; an unmerged graft checks theta_pre under its grafted entries at every
            forward, so purify those merged). Runs in the model's current mode (``model.eval()``: no dropout).
        region: Where training may act, typically a union ``gamma_G`` from :func:`group_regions`.
        task_batches: Batches of keyword arguments for ``model`` (with labels), per task of the group.
        steps: Number of steps (the paper takes 10).
        learning_rate: Of the default optimizer, plain SGD as the paper fine-tunes with (no momentum, no decay);
            the default 1e-2 is the largest of the paper's SGD fine-tuning grid, since a few steps must move the
            region noticeably. Ignored when ``optimizer`` is given.
        optimizer: Your own optimizer over the model's parameters (or the region's tensors).

    During the steps only the tensors ``region`` names require a gradient (graft tensors never); every
    ``requires_grad`` flag is restored, the gradient hooks removed and the gradients cleared afterwards, also on
    error. A non-finite loss is a ``ValueError`` naming the step and task, raised before that step changes anything.

    Returns:
        The joint loss of each step (at the parameters before that step).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}.")
    if not isinstance(region, Region):
        raise TypeError(f"region must be a Region, got {type(region).__name__}.")
    if region.num_entries == 0:
        raise ValueError("region is empty: purify has nothing to train.")
    if not isinstance(task_batches, Mapping) or not task_batches:
        raise ValueError("task_batches must be a non-empty mapping of task name -> batches.")
    if optimizer is None and not (math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be finite and > 0, got {learning_rate!r}.")

    flags = {param: param.requires_grad for param in model.parameters()}
    inside = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if "graft_" not in name and peft_free_name(name.removeprefix(PEFT_PREFIX)) in region:
            inside[id(param)] = param
    device = next(iter(flags)).device if flags else torch.device("cpu")
    losses: list[float] = []
    restriction = None
    try:
        for param in flags:
            param.requires_grad_(id(param) in inside)
        restriction = restrict_training(model, allowed=region)  # also checks the region's names and indices
        if optimizer is None:
            optimizer = torch.optim.SGD(list(inside.values()), lr=learning_rate)
        streams = {task: _cycled(task, batches) for task, batches in task_batches.items()}
        model.zero_grad(set_to_none=True)
        for step in range(1, steps + 1):
            joint = 0.0
            for task, stream in streams.items():
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in next(stream).items()}
                loss = model(**batch).loss
                if loss is None:
                    raise ValueError(f"Task {task!r}: the model returned no loss (do its batches hold labels?).")
                if not torch.isfinite(loss.detach()).all():
                    raise ValueError(
                        f"Non-finite loss of task {task!r} at purify step {step} of {steps}: nothing was changed "
                        "by this step."
                    )
                loss.backward()  # one task at a time: the gradients add up to that of the joint loss
                joint += float(loss.detach())
            restriction.step(optimizer)
            model.zero_grad(set_to_none=True)
            losses.append(joint)
    finally:
        model.zero_grad(set_to_none=True)
        if restriction is not None:
            restriction.remove()
        for param, flag in flags.items():
            param.requires_grad_(flag)
    return losses


def plot_region_matrix(
    matrix: torch.Tensor | Sequence[Sequence[float]],
    row_names: Sequence[str],
    col_names: Sequence[str],
    title: str | None = None,
    value_format: str = ".2f",
    *,
    xlabel: str | None = "Task",
    ylabel: str | None = "Region",
    size_px: tuple[int, int] | None = None,
    dpi: int = DEFAULT_DPI,
) -> Figure:
    """An annotated heatmap of a region matrix (paper Figure 8): rows on the y-axis, columns on the x-axis.

    Args:
        matrix: ``len(row_names) x len(col_names)`` values, e.g. from :func:`overlap_matrix` or
            :func:`relative_gain_matrix`.
        row_names: Names of the rows (regions: tasks or groups), top to bottom.
        col_names: Names of the columns (tasks), left to right.
        title: Axes title.
        value_format: Format spec of each cell's annotation.
        xlabel, ylabel: Axis labels (``None``: none).
        size_px: Figure size ``(width, height)`` in pixels at ``dpi`` (default: grows with the matrix).
        dpi: Resolution.

    Returns:
        A ``matplotlib.figure.Figure`` with an Agg canvas and a colorbar (save it with ``save_figure``).
    """
    values = torch.as_tensor(matrix, dtype=torch.float64).detach().cpu()
    rows, cols = list(row_names), list(col_names)
    if values.dim() != 2 or values.shape != (len(rows), len(cols)):
        raise ValueError(
            f"matrix has shape {tuple(values.shape)} but {len(rows)} row names and {len(cols)} column names were given."
        )
    if not rows or not cols:
        raise ValueError("plot_region_matrix needs at least one row and one column.")
    format(0.0, value_format)  # a bad format spec fails here, before drawing
    if size_px is None:
        size_px = (max(320, 160 + 56 * len(cols)), max(280, 120 + 44 * len(rows)))
    fig = _new_figure(size_px, dpi)
    ax = fig.add_subplot()
    image = ax.imshow(values.numpy(), cmap="Blues", aspect="auto")
    finite = values[torch.isfinite(values)]
    middle = float((finite.min() + finite.max()) / 2) if finite.numel() else 0.0
    for i in range(len(rows)):
        for j in range(len(cols)):
            value = float(values[i, j])
            ax.text(
                j, i, format(value, value_format), ha="center", va="center", fontsize="small",
                color="white" if math.isfinite(value) and value > middle else "black",
            )  # fmt: skip
    ax.set_xticks(range(len(cols)), labels=cols, rotation=45, ha="right", rotation_mode="anchor")
    ax.set_yticks(range(len(rows)), labels=rows)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize="medium")
    fig.colorbar(image, ax=ax)
    return fig
