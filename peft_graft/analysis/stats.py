"""Where a graft's entries sit: per tensor, per layer, per module type (paper Figures 9-10)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ..parameter_layout import build_layout
from ..regions import Region

# Ordered: the first matching rule names the module type of a parameter.
MODULE_TYPE_RULES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE))
    for kind, pattern in (
        ("layer_norm", r"(layernorm|layer_norm|\bln_\w*|\.ln\w*\.|norm\.(weight|bias)$|rmsnorm)"),
        ("embeddings", r"(embed|\.wte\.|\.wpe\.)"),
        ("pooler", r"(^|\.)pooler\."),
        ("head", r"(^|\.)(lm_head|classifier|score|cls)\."),
        ("attention_query", r"(\.query\.|q_proj)"),
        ("attention_key", r"(\.key\.|k_proj)"),
        ("attention_value", r"(\.value\.|v_proj)"),
        ("attention_qkv", r"(c_attn|qkv|query_key_value)"),
        ("attention_output", r"(attention\.output\.dense|o_proj|attn\.c_proj|out_proj|attn\.dense)"),
        ("ffn_in", r"(intermediate\.dense|c_fc|gate_proj|up_proj|fc1|dense_h_to_4h|mlp\.fc_in)"),
        ("ffn_out", r"(output\.dense|mlp\.c_proj|down_proj|fc2|dense_4h_to_h|mlp\.fc_out)"),
    )
)
LAYER_PATTERN = re.compile(r"\.(?:layer|layers|h|block|blocks)\.(\d+)\.")


def module_type(name: str) -> str:
    """The module type of parameter ``name`` (``"other"`` when no rule matches)."""
    return next((kind for kind, pattern in MODULE_TYPE_RULES if pattern.search(name)), "other")


def layer_index(name: str) -> int | None:
    """The transformer block of parameter ``name``, or ``None`` outside the blocks."""
    match = LAYER_PATTERN.search(name)
    return int(match.group(1)) if match else None


@dataclass
class GraftStats:
    """Counts of grafted entries. ``sparsity`` is grafted entries over all parameters of the base model."""

    num_entries: int
    num_parameters: int
    per_tensor: dict[str, int] = field(default_factory=dict)
    per_layer: dict[int | None, int] = field(default_factory=dict)
    per_module_type: dict[str, int] = field(default_factory=dict)
    modules_to_save_parameters: int = 0

    @property
    def sparsity(self) -> float:
        return self.num_entries / self.num_parameters if self.num_parameters else 0.0

    def to_markdown(self) -> str:
        """A short markdown report: totals, then entries by module type and by layer."""
        lines = [
            f"Grafted entries: {self.num_entries} of {self.num_parameters} parameters "
            f"(sparsity {self.sparsity:.6%}); stored whole (modules_to_save): {self.modules_to_save_parameters}",
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
    )
