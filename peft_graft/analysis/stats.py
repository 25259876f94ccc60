"""Where a graft's entries sit: per tensor, per layer, per module type (paper Figures 9-10)."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ..parameter_layout import build_layout, num_base_parameters
from ..parameter_names import layer_index, module_type
from ..regions import Region


@dataclass
class GraftStats:
    """Counts of grafted entries.

    Attributes:
        num_entries: Grafted entries (each an entry of one parameter tensor).
        num_parameters: Parameters of the base model outside the heads stored whole (``modules_to_save``).
        total_parameters: All parameters of the base model, each tensor once, heads included: the denominator of
            :attr:`fraction_of_parameters` (0 when unknown).
        per_tensor, per_layer, per_module_type: Grafted entries by tensor name, transformer block, module type.
        modules_to_save_parameters: Parameters this adapter stores whole (its copies of ``modules_to_save`` heads).
    """

    num_entries: int
    num_parameters: int
    per_tensor: dict[str, int] = field(default_factory=dict)
    per_layer: dict[int | None, int] = field(default_factory=dict)
    per_module_type: dict[str, int] = field(default_factory=dict)
    modules_to_save_parameters: int = 0
    total_parameters: int = 0

    @property
    def fraction_of_parameters(self) -> float:
        """Grafted entries over all parameters of the base model (``total_parameters``): the paper's "0.01% of the
        parameters". Not ``GraftConfig.sparsity``, which is a fraction of the eligible entries."""
        total = self.total_parameters or self.num_parameters
        return self.num_entries / total if total else 0.0

    @property
    def sparsity(self) -> float:
        """Deprecated: ``num_entries / num_parameters``. The package's reports use :attr:`fraction_of_parameters`;
        ``sparsity`` names ``GraftConfig``'s budget (a fraction of the eligible entries) only."""
        warnings.warn(
            "GraftStats.sparsity is deprecated: it is num_entries / num_parameters, not GraftConfig.sparsity (a "
            "fraction of the eligible entries). Use GraftStats.fraction_of_parameters (entries over all parameters).",
            FutureWarning,
            stacklevel=2,
        )
        return self.num_entries / self.num_parameters if self.num_parameters else 0.0

    def to_markdown(self) -> str:
        """A short markdown report: totals, then entries by module type and by layer."""
        total = self.total_parameters or self.num_parameters
        lines = [
            f"Grafted entries: {self.num_entries:,} = {self.fraction_of_parameters:.6%} of all {total:,} parameters "
            f"of the base model; stored whole (modules_to_save): {self.modules_to_save_parameters:,}",
            "",
            "| module type | entries |",
            "| --- | --- |",
            *(f"| {kind} | {count} |" for kind, count in sorted(self.per_module_type.items())),
            "",
            "| layer | entries |",
            "| --- | --- |",
            *(f"| {'-' if i is None else i} | {c} |" for i, c in sorted(self.per_layer.items(), key=_layer_key)),
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def _layer_key(item: tuple[int | None, int]) -> int:
    return -1 if item[0] is None else item[0]


def compute_graft_stats(model: nn.Module, region: Region, adapter_name: str) -> GraftStats:
    """Statistics of ``region`` on ``model`` (the model under the tuner, with graft layers)."""
    whole = sum(p.numel() for n, p in model.named_parameters() if f".modules_to_save.{adapter_name}." in n)
    base_parameters = sum(info.parameter.numel() for info in build_layout(model).tensors.values())
    total = num_base_parameters(model)
    per_tensor = {name: int(indices.numel()) for name, indices in region.items()}
    per_layer, per_type = Counter(), Counter()
    for name, count in per_tensor.items():
        per_layer[layer_index(name)] += count
        per_type[module_type(name)] += count
    return GraftStats(
        num_entries=region.num_entries,
        num_parameters=base_parameters,
        per_tensor=per_tensor,
        per_layer=dict(per_layer),
        per_module_type=dict(per_type),
        modules_to_save_parameters=whole,
        total_parameters=total,
    )
