"""How a graft's region was found, recorded in its config (``GraftConfig.region_provenance``) and told by its card.

``GraftConfig.region`` names the strategy that chose the (starting) region; the provenance also says whether the
region was then learned, by what, over how many steps, and which mask was kept. It is a plain JSON object, so that a
saved ``adapter_config.json`` stays readable by any tool. Keys (all optional but ``strategy``):

- ``strategy``: the region strategy (``GraftConfig.region``) that chose the region, or gamma_base when learned.
- ``start_entries``: entries of that region; ``eligible_entries``: entries it was chosen among (the denominator of
  ``GraftConfig.sparsity``); ``num_parameters``: all parameters of the base model (each tensor once).
- ``learned``: whether the region was learned (paper Eq. 3-4) from that start; ``trainer``: ``"MaskTrainer"`` when
  MaskTrainer learned it; ``search_space_entries``: the entries S covered (``None``: every eligible entry, the paper);
  ``steps_trained``: optimizer steps of S.
- ``kept``: which mask the graft holds: ``"strategy"`` (the region as chosen), ``"round(gamma)"``,
  ``"top num_entries of gamma"``, ``"best evaluated mask"``, ``"gamma_base"`` (the start won the selection),
  ``"given entries"`` (``harden_region(entries=...)``) or ``"combination"``.
- ``selected_step`` (0 = gamma_base), ``selection_metric``, ``selection_value``: the evaluation that selected the mask
  (``keep_best_mask``); with ``selection_alpha``: ``selection_alpha``, ``selection_p_value``, ``evaluated_masks``.
- ``scores_from_step``: with ``load_best_model_at_end``, the step of the best checkpoint whose scores were hardened.
- ``metrics``: the evaluation metrics of the kept mask (MaskTrainer), by name.
- ``combined_from``, ``combination``: the grafts and the rule of ``add_combined_adapter``.

Descriptive only: loading never reads it, so it is not covered by the integrity checks (a graft saved before it
existed has none and loads as before); a malformed one is refused with the other fields the library fills in.
"""

from __future__ import annotations

import math
from typing import Any

PROVENANCE_FIELD = "region_provenance"
KEPT = (
    "strategy",
    "round(gamma)",
    "top num_entries of gamma",
    "best evaluated mask",
    "gamma_base",
    "given entries",
    "combination",
)
_MAX_DEPTH = 3


def check_provenance(value: Any) -> None:
    """Refuse a ``region_provenance`` that is not ``None`` or a JSON object of the documented shape (``ValueError``
    naming the field)."""
    if value is None:
        return
    problem = None
    if not isinstance(value, dict):
        problem = f"must be a JSON object or null, got {type(value).__name__}"
    elif not isinstance(value.get("strategy"), str):
        problem = f"must name its 'strategy' (a string), got {value.get('strategy')!r}"
    elif value.get("kept") is not None and value.get("kept") not in KEPT:
        problem = f"'kept' must be one of {KEPT} or null, got {value.get('kept')!r}"
    elif not _is_json(value, 0):
        problem = "must hold only strings, finite numbers, booleans, null, lists and objects (3 levels at most)"
    if problem:
        raise ValueError(
            f"region_provenance {problem}. This field is written by peft_graft when a graft is created or its region "
            "learned: the adapter_config.json was altered or not written by peft_graft. Save the graft again."
        )


def _is_json(value: Any, depth: int) -> bool:
    if value is None or isinstance(value, (bool, str, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if depth >= _MAX_DEPTH:
        return False
    if isinstance(value, list):
        return all(_is_json(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v, depth + 1) for k, v in value.items())
    return False


def chosen(strategy: str, start_entries: int, eligible_entries: int, num_parameters: int, learning: bool,
           search_space_entries: int | None) -> dict[str, Any]:  # fmt: skip
    """The provenance of a new graft: its region chosen by ``strategy``; ``learning``: to be learned from there."""
    out: dict[str, Any] = {
        "strategy": strategy,
        "start_entries": int(start_entries),
        "eligible_entries": int(eligible_entries),
        "num_parameters": int(num_parameters),
        "learned": bool(learning),
        "kept": None if learning else "strategy",
    }
    if learning:
        out["search_space_entries"] = None if search_space_entries is None else int(search_space_entries)
    return out


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among evaluation ``metrics``, without timings (what a card can report)."""
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and not any(word in name for word in ("runtime", "per_second"))
    }


def describe(provenance: dict[str, Any] | None, region: str) -> str:
    """One sentence saying how the region was found (``region``: ``GraftConfig.region``, for older saves)."""
    if not provenance:
        return (
            f"Region strategy `{region}`; how the region was found beyond that is not recorded (saved by a peft_graft "
            "older than `region_provenance`)."
        )
    strategy = provenance.get("strategy", region)
    start = provenance.get("start_entries")
    start_text = f" ({start:,} entries)" if isinstance(start, int) else ""
    kept = provenance.get("kept")
    if kept == "combination":
        names = ", ".join(f"`{name}`" for name in provenance.get("combined_from") or [])
        return f"Union of the regions of {names}, values combined by `{provenance.get('combination')}`."
    if not provenance.get("learned"):
        return f"Chosen by the `{strategy}` strategy{start_text}, not learned."
    trainer = provenance.get("trainer") or "a custom loop"
    steps = provenance.get("steps_trained")
    text = f"Learned by {trainer} (paper Eq. 3-4) from gamma_base, the `{strategy}` region{start_text}"
    text += f" over {steps:,} steps" if isinstance(steps, int) else ""
    search = provenance.get("search_space_entries", "absent")
    if search is None:
        text += ", scores S over every eligible entry"
    elif isinstance(search, int):
        text += f", scores S over a search space of {search:,} entries"
    if kept is None:
        return text + "; the region is still being learned (this save holds the mask hardening would keep now)."
    step = provenance.get("selected_step")
    if kept == "gamma_base":
        text += "; gamma_base was kept: no learned mask beat it"
    elif kept == "best evaluated mask":
        text += f"; the best evaluated mask was kept (step {step})" if isinstance(step, int) else "; best mask kept"
    else:
        text += f"; kept: {kept}"
    if isinstance(provenance.get("scores_from_step"), int):
        text += f" of the scores at step {provenance['scores_from_step']} (the best checkpoint)"
    metric, value = provenance.get("selection_metric"), provenance.get("selection_value")
    if metric is not None and isinstance(value, (int, float)):
        text += f", selected on `{metric}` = {value:.4g}"
    p_value = provenance.get("selection_p_value")
    if isinstance(p_value, (int, float)):
        alpha, masks = provenance.get("selection_alpha"), provenance.get("evaluated_masks")
        text += f" (sign test p-value {p_value:.3g} vs gamma_base"
        text += f", alpha {alpha} over {masks} evaluated masks)" if alpha is not None else ")"
    return text + "."
