"""Merging several task grafts of one base model into one graft, with a head per task.

:func:`merge_grafts` builds one merged *body* adapter by a named rule:

* ``"stitch"`` (Localize-and-Stitch, He et al., TMLR 2024): the union of the grafts' regions, each entry the average
  of the grafts that hold it (:meth:`GraftModel.add_combined_adapter`'s ``"average"``).
* ``"stitch_dataless"``: the same on each task's top ``density`` of ``|tau|`` (L&S's dataless variant).
* ``"task_arithmetic"``, ``"ties"``, ``"dare_ties"``, ``"dare_linear"``: peft's :mod:`peft.utils.merge_utils`
  functions on the task vectors ``tau_t`` (a graft's stored deltas, 0 off its region), with ``weights`` (the scaling
  ``lambda``, one number or one per graft) and ``density``.
* ``"consensus_ta"``, ``"consensus_ties"`` (Consensus merging, Wang et al., ICML 2024): task arithmetic or TIES on the
  task vectors after dropping the entries that fewer than ``consensus_k`` tasks' TALL masks hold.
* ``"wudi"``, ``"wudi_adam"`` (WUDI-Merging, Cheng et al., ICML 2025) and ``"regmean"`` (RegMean, Jin et al., ICLR
  2023): rules on whole tensors (:mod:`peft_graft.merge_rules`); RegMean takes each task's input Gram matrices
  (``grams``, :func:`peft_graft.input_statistics.input_grams`). Their merged body holds whole matrices.

``lines=(alpha, beta)`` scales task arithmetic's, TIES's and the Consensus rules' merged vector per block (LiNeS, Wang
et al., ICLR 2025); ``scale`` scales a stitch. A :class:`TaskVectorStack` holds the grafts' task vectors stacked once,
for many merges of the same grafts (``stack=``); :func:`task_vector_norms` gives each task's norm per layer type.

peft applies these functions tensor by tensor (to one LoRA delta at a time); here they get each task's *whole* task
vector at once, flattened over the union of the grafts' entries, so that TIES's magnitude trim keeps the top
``density`` of the task vector (as the TIES and DARE papers do), not of each tensor; DARE's random drops are per
entry either way. ``density`` is therefore a fraction of that union (with full grafts: every entry fine-tuning moved).
The averaging of ``stitch`` has no peft counterpart (``disjoint_merge`` averages only entries of the elected sign).
A merged graft stores the entries its rule changed: the global rules on full task vectors change almost every moved
entry, so their merged graft is about as large as one full fine-tune's (see :attr:`MergedGraft.nbytes`).

Each task keeps its own head (the grafts' ``modules_to_save``, stored whole): :meth:`MergedGraft.use_task` writes one
into the merged adapter's copy. The merged adapter saves, loads, merges and serves like any graft; the heads are saved
beside it (:meth:`MergedGraft.save_pretrained`, :meth:`MergedGraft.from_pretrained`).
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import PeftModel
from peft.utils.other import ModulesToSaveWrapper
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ._checksum import state_checksum
from ._files import check_file
from .merge_rules import (
    CONSENSUS_RULES,
    DARE_RULES,
    SIGN_RULES,
    combine,
    layer_type,
    lines_scales,
    mean_task_vector,
    regmean,
    top_magnitude,
    trim,
    wudi_adam,
    wudi_closed_form,
)
from .parameter_layout import build_layout
from .regions import Region
from .sharding import refuse_sharded
from .tuner.layer import GraftLayer
from .tuner.model import GraftModel, _combine, _exact_after_combining, _record_layout, check_adapter_name
from .tuner.persistence import saved_beside

MERGE_RULES = ("stitch", "stitch_dataless", "task_arithmetic", "ties", "dare_ties", "dare_linear", "consensus_ta",
               "consensus_ties", "wudi", "wudi_adam", "regmean")  # fmt: skip
DENSITY_RULES = ("stitch_dataless", "ties", "dare_ties", "dare_linear", "consensus_ties")
WEIGHTED_RULES = ("task_arithmetic", "ties", "dare_ties", "dare_linear", "consensus_ta", "consensus_ties")
TENSOR_RULES = ("wudi", "wudi_adam", "regmean")  # per whole tensor (peft_graft.merge_rules)
LINES_RULES = ("task_arithmetic", "ties", "consensus_ta", "consensus_ties")
STITCH_RULES = ("stitch", "stitch_dataless")
HEADS_FILE = "task_heads.safetensors"


@dataclass
class MergedGraft:
    """A merged body adapter ``adapter_name`` of ``model`` and each task's head (``heads[task][tensor name]``)."""

    model: PeftModel
    adapter_name: str
    rule: str
    heads: dict[str, dict[str, torch.Tensor]]
    options: dict = field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        return list(self.heads)

    @property
    def num_entries(self) -> int:
        """Entries the merged body grafts (changes from theta_pre)."""
        return self.model.get_region(self.adapter_name).num_entries

    @property
    def nbytes(self) -> dict[str, int]:
        """Storage: the merged body (indices, fp32 values, exact entries) and the heads of all tasks, in bytes."""
        body = 0
        for layer in _graft_layers(self.model).values():
            if layer.has_region(self.adapter_name):  # its own tensors or views of a packed store
                entries = (*layer.entries(self.adapter_name), *layer.exact_entries(self.adapter_name))
                body += sum(tensor.numel() * tensor.element_size() for tensor in entries)
        heads = sum(t.numel() * t.element_size() for head in self.heads.values() for t in head.values())
        return {"body": body, "heads": heads, "total": body + heads}

    def use_task(self, task: str) -> None:
        """Activate the merged adapter with ``task``'s head."""
        if task not in self.heads:
            raise ValueError(f"No head for task {task!r}; this merge has {self.tasks}.")
        if self.adapter_name not in self.model.peft_config:
            raise ValueError(f"The merged adapter {self.adapter_name!r} is no longer in the model (deleted): merge "
                             "again, or load it with MergedGraft.from_pretrained.")  # fmt: skip
        copies = _head_copies(self.model, self.adapter_name)
        missing = sorted(set(self.heads[task]) - set(copies))
        if missing:
            raise ValueError(f"Task {task!r}'s head tensors {missing} have no copy in adapter {self.adapter_name!r}.")
        with torch.no_grad():
            for name, tensor in self.heads[task].items():
                copies[name].copy_(tensor)
        self.model.set_adapter(self.adapter_name)

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Save the merged adapter (peft's ``save_pretrained``) and the task heads beside it, with their checksum, in
        one atomic save (:func:`~peft_graft.tuner.persistence.saved_beside`); returns its folder."""
        rel = HEADS_FILE if self.adapter_name == "default" else os.path.join(self.adapter_name, HEADS_FILE)
        with saved_beside({rel: self._save_heads}):
            self.model.save_pretrained(str(save_directory), selected_adapters=[self.adapter_name])
        return Path(save_directory) if self.adapter_name == "default" else Path(save_directory) / self.adapter_name

    def _save_heads(self, path: str) -> None:
        tensors = {f"{task}/{name}": t.detach().cpu().contiguous() for task, head in self.heads.items()
                   for name, t in head.items()}  # fmt: skip
        metadata = {"rule": self.rule, "tasks": json.dumps(self.tasks), "options": json.dumps(self.options),
                    "body_checksum": body_checksum(self.model, self.adapter_name)}  # fmt: skip
        metadata["checksum"] = state_checksum(tensors, metadata)
        save_file(tensors, path, metadata=metadata)  # staged: nothing replaced if the loader's checks refuse it
        try:
            _read_heads(path)
        except ValueError as error:
            raise ValueError(
                f"MergedGraft.save_pretrained refused: the task heads would be saved as a file its own loader refuses "
                f"({error}). Nothing was written; fix the heads in memory (MergedGraft.heads) or merge again."
            ) from error

    @classmethod
    def from_pretrained(
        cls, model: nn.Module, path: str | os.PathLike, adapter_name: str = "merged", check_body: bool = True, **kwargs
    ) -> MergedGraft:
        """Load a merged graft saved by :meth:`save_pretrained` onto ``model`` (a base model or a graft PeftModel).

        The heads file records a checksum of the merged body it was saved with, and loading refuses a body it does not
        match (heads of another merge). A file saved before heads recorded it is refused too, unless ``check_body`` is
        False (then save it again to bind them). On any error the model is left as it was."""
        heads_path = Path(path) / HEADS_FILE
        if check_file(heads_path, "task heads file", missing_ok=True) is None:  # a folder, device or FIFO: refused
            raise ValueError(f"{str(path)!r} holds no {HEADS_FILE}: it is not a merged graft saved by MergedGraft.")
        if isinstance(model, PeftModel) and adapter_name in model.peft_config:
            raise ValueError(f"An adapter named {adapter_name!r} is already in the model: load the merged graft under "
                             "another adapter_name (MergedGraft.from_pretrained(..., adapter_name=...)).")  # fmt: skip
        rule, heads, options, recorded = _read_heads(str(heads_path))
        created = not isinstance(model, PeftModel)
        if created:
            model = PeftModel.from_pretrained(model, str(path), adapter_name=adapter_name, **kwargs)
        else:
            model.load_adapter(str(path), adapter_name, **kwargs)
        try:
            _check_loaded_heads(model, adapter_name, heads_path, heads, recorded, check_body)
        except BaseException:
            if created:
                model.unload()  # the base model's layers back, as they were
            else:
                model.delete_adapter(adapter_name)
            raise
        return cls(model, adapter_name, rule, heads, options)


def _check_loaded_heads(model, adapter_name: str, heads_path: Path, heads: dict, recorded: str | None, check: bool):
    """The heads fit the loaded adapter's head copies (names, shapes) and were saved with this body."""
    copies = _head_copies(model, adapter_name)
    for task, head in heads.items():
        if set(head) != set(copies):
            raise ValueError(f"{heads_path}: the head of task {task!r} holds {sorted(head)}, the merged adapter's "
                             f"heads are {sorted(copies)}: the file is corrupt or from another model.")  # fmt: skip
        for name, tensor in head.items():
            if tensor.shape != copies[name].shape:
                raise ValueError(f"{heads_path}: head tensor {name!r} of task {task!r} has shape "
                                 f"{tuple(tensor.shape)}, the merged adapter's has {tuple(copies[name].shape)}: the "
                                 "heads are of another model.")  # fmt: skip
    if recorded is None:
        if check:
            raise ValueError(
                f"{heads_path} records no checksum of its merged body (saved before heads were bound to their body), "
                "so nothing shows the heads belong to this body. If they do, load with check_body=False and save the "
                "merged graft again (MergedGraft.save_pretrained) to bind them."
            )
    elif recorded != body_checksum(model, adapter_name):
        raise ValueError(
            f"{heads_path}: the task heads were saved with another merged body than the adapter in "
            f"{str(heads_path.parent)!r} (its checksum differs from the one they record): the heads file "
            "is of another merge. Save the merge's body and heads together (MergedGraft.save_pretrained)."
        )


def body_checksum(model: PeftModel, adapter_name: str) -> str:
    """A checksum of a graft adapter's body: per graft layer, its flat indices, fp32 values and exact entries."""
    tensors = {}
    for module, layer in _graft_layers(model).items():
        if layer.has_region(adapter_name):
            indices, values = layer.entries(adapter_name)
            positions, targets = layer.exact_entries(adapter_name)
            parts = {"indices": indices.to(torch.int64), "values": values.float(), "positions": positions.to(
                torch.int64), "targets": targets.float()}  # fmt: skip
            tensors |= {f"{module}/{k}": v.detach().cpu().contiguous() for k, v in parts.items()}
    return state_checksum(tensors, {})


def _read_heads(path: str) -> tuple[str, dict[str, dict[str, torch.Tensor]], dict, str | None]:
    """``(rule, heads, options, body checksum or None)`` of a task heads file, checked: readable, its checksum, floating
    point and finite tensors, each of a task it lists. Every problem is a ``ValueError`` naming the file."""
    fix = "Save the merged graft again (MergedGraft.save_pretrained)."
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (no __iter__)
        tasks, options = json.loads(metadata.get("tasks", "[]")), json.loads(metadata.get("options", "{}"))
    except (SafetensorError, ValueError) as error:  # json's JSONDecodeError is a ValueError
        raise ValueError(f"{path!r} is truncated or corrupt, or its metadata is not JSON ({error}). {fix}") from error
    if metadata.get("checksum") != state_checksum(tensors, metadata):
        state = "records no checksum" if "checksum" not in metadata else "does not match the checksum it records"
        raise ValueError(f"{path!r} {state}: the file is corrupt or was altered after saving. {fix}")
    if not (isinstance(tasks, list) and all(isinstance(t, str) for t in tasks) and isinstance(options, dict)):
        raise ValueError(f"{path!r}: its metadata 'tasks' must be a list of names and 'options' an object. {fix}")
    heads: dict[str, dict[str, torch.Tensor]] = {task: {} for task in tasks}
    for key, tensor in tensors.items():
        task, _, name = key.partition("/")
        if task not in heads:
            raise ValueError(f"{path!r}: tensor {key!r} names no task of {tasks}: the file is corrupt. {fix}")
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            problem = "holds NaN or inf" if tensor.is_floating_point() else f"is {tensor.dtype}, not floating point"
            raise ValueError(f"{path!r}: head tensor {key!r} {problem}: the file is corrupt. {fix}")
        heads[task][name] = tensor
    return metadata.get("rule", ""), heads, options, metadata.get("body_checksum")


def merge_grafts(
    model: PeftModel,
    grafts: Mapping[str, str] | Sequence[str],
    rule: str,
    adapter_name: str = "merged",
    *,
    weights: float | Sequence[float] | None = None,
    density: float | None = None,
    majority_sign_method: str = "total",
    seed: int = 0,
    exclude: Region | None = None,
    consensus_k: int = 2,
    tall_lambda: float = 1.0,
    lines: tuple[float, float] | None = None,
    scale: float | None = None,
    grams: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    regmean_alpha: float = 0.95,
    wudi_steps: int = 400,
    wudi_lr: float = 1e-5,
    stack: TaskVectorStack | None = None,
) -> MergedGraft:
    """Merge task grafts of ``model``'s base into one new graft adapter ``adapter_name`` by ``rule``.

    Args:
        model: A ``PeftModel`` of the graft method.
        grafts: Task name -> a loaded adapter's name, a saved graft's folder or a Hub id (loaded under the task name);
            or a list of loaded adapter names (the task names).
        rule: One of :data:`MERGE_RULES` (see the module docstring).
        weights: The global rules' scaling: one number (``lambda`` for every task) or one per graft; default 1.
        density: Fraction of the union of the grafts' entries each task keeps, for ``stitch_dataless``, ``ties`` and
            the DARE rules.
        majority_sign_method: TIES/DARE-TIES sign election: ``"total"`` or ``"frequency"`` (peft's).
        seed: Seed of DARE's random drops.
        exclude: Entries never merged (by parameter name), e.g. where the task regions overlap.
        consensus_k: For the consensus rules: an entry is kept when at least this many tasks' TALL masks hold it.
        tall_lambda: For the consensus rules: task t's TALL mask holds ``|tau_t| > tall_lambda * |tau_MTL - tau_t|``.
        lines: ``(alpha, beta)``: LiNeS's per-layer scaling of the merged task vector, for :data:`LINES_RULES`
            (block ``l`` of ``L`` times ``alpha + beta * l / (L - 1)``, tensors outside the blocks times ``alpha``).
        scale: For the stitch rules: the stitched values times this number (default 1).
        grams: For ``"regmean"``: task -> linear layer (as :meth:`GraftModel.graft_layers` names it) -> the Gram matrix
            of its inputs under that task's graft (:func:`peft_graft.input_statistics.input_grams`).
        regmean_alpha: For ``"regmean"``: the Gram matrices' off-diagonal entries are scaled by this (in [0, 1]).
        wudi_steps, wudi_lr: For ``"wudi_adam"``: Adam's steps and learning rate (the reference's 400 and 1e-5).
        stack: The grafts' :class:`TaskVectorStack`, built once for many merges of the same grafts (it must hold the
            same grafts and exclude; one whose grafts changed since is refused).

    Returns:
        The :class:`MergedGraft` (the model holds the new adapter, with the first task's head active in it). On any
        error the model is left as it was (grafts loaded by this call are removed again).
    """
    tuner = _graft_tuner(model)
    refuse_sharded(
        model.named_parameters(),
        "merge_grafts()",
        "merge the grafts in one process, on the whole model (PeftModel.from_pretrained(base, first graft), "
        "merge_grafts, MergedGraft.save_pretrained), then load the merged graft before sharding the model.",
    )
    sources = _graft_names(grafts)
    if not sources:
        raise ValueError("grafts is empty: give at least one task graft to merge.")
    options = _check_options(rule, len(sources), weights, density, majority_sign_method, seed)
    options.update(_consensus_options(rule, len(sources), consensus_k, tall_lambda))
    options.update(rule_options(rule, list(sources), lines, scale, grams, regmean_alpha, wudi_steps, wudi_lr))
    if stack is not None and not isinstance(stack, TaskVectorStack):
        raise TypeError(f"stack must be a TaskVectorStack, got {type(stack).__name__}.")
    check_adapter_name(adapter_name)
    if adapter_name in model.peft_config:
        raise ValueError(f"An adapter named {adapter_name!r} already exists: choose another adapter_name.")
    if exclude is not None and not isinstance(exclude, Region):
        raise TypeError(f"exclude must be a Region, got {type(exclude).__name__}.")
    loaded = []
    try:
        names = {}
        for task, source in sources.items():
            if source in model.peft_config:
                names[task] = source
                continue
            if task in model.peft_config:
                raise ValueError(f"Task {task!r}: {source!r} is not a loaded adapter, and an adapter named {task!r} "
                                 "exists already to load it under: rename the task.")  # fmt: skip
            try:
                model.load_adapter(source, task)
            except Exception as error:
                raise ValueError(f"Task {task!r}: could not load the graft {source!r}: {error}") from error
            loaded.append(task)
            names[task] = task
        if stack is None:
            stack = TaskVectorStack(model, names, exclude, _one_merge=True)
        else:
            stack.check(model, names, exclude)
        merged = _merged_entries(tuner, stack, rule, options, grams)
        _check_finite(tuner, merged, rule, options, None if rule in TENSOR_RULES else stack.base_bounds)
        heads = {task: {n: t.detach().clone() for n, t in _head_copies(model, name).items()}
                 for task, name in names.items()}  # fmt: skip
        _add_merged_adapter(tuner, list(names.values()), adapter_name, merged, rule)
    except BaseException:
        for name in loaded:
            model.delete_adapter(name)
        raise
    return MergedGraft(model, adapter_name, rule, heads, options)


# ---------------------------------------------------------------------------------------------------- checks
def _graft_tuner(model: object) -> GraftModel:
    tuner = getattr(model, "base_model", None)
    if not isinstance(model, PeftModel) or not isinstance(tuner, GraftModel):
        raise TypeError(
            f"model must be a PeftModel of the graft method, got {type(model).__name__}: load the first graft with "
            "PeftModel.from_pretrained(base_model, folder), then pass the others by folder."
        )
    return tuner


def _check_options(rule, count, weights, density, majority_sign_method, seed) -> dict:
    if rule not in MERGE_RULES:
        raise ValueError(f"Unknown rule {rule!r}: use one of {MERGE_RULES}.")
    if rule in DENSITY_RULES:
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density <= 1.0:
            raise ValueError(f"rule {rule!r} needs density in (0, 1] (the fraction of entries kept), got {density!r}.")
    elif density is not None:
        raise ValueError(f"rule {rule!r} takes no density (only {DENSITY_RULES} do), got {density!r}.")
    if rule in WEIGHTED_RULES:
        weights = 1.0 if weights is None else weights
        values = [weights] * count if isinstance(weights, (int, float)) and not isinstance(weights, bool) else weights
        if not isinstance(values, Sequence) or len(values) != count:
            raise ValueError(f"weights must be one number or {count} (one per graft), got {weights!r}.")
        values = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan") for v in values]
        if not all(torch.isfinite(torch.tensor(values))):
            raise ValueError(f"weights must be finite numbers, got {weights!r}.")
        weights = values
    elif weights is not None:
        raise ValueError(f"rule {rule!r} takes no weights: stitching averages the overlapping entries.")
    if majority_sign_method not in ("total", "frequency"):
        raise ValueError(f"majority_sign_method must be 'total' or 'frequency', got {majority_sign_method!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    return {"weights": weights, "density": density, "majority_sign_method": majority_sign_method, "seed": seed}


def _check_grafts(tuner: GraftModel, names: dict[str, str], base: bool = True) -> dict[str, tuple[torch.Tensor, str]]:
    """Same layout (heads), hard regions, nothing merged and (with ``base``) recorded theta_pre equal to the model's
    base values. Returns the last base checksum computed per layer, with its indices (:func:`_base_checksum`)."""
    layers, checked = tuner.graft_layers(), {}
    if any(layer.merged for layer in layers.values()):
        raise ValueError("The model has merged adapters: unmerge_adapter() before merging grafts.")
    first_task, first = next(iter(names.items()))
    reference = sorted(set(tuner.peft_config[first].modules_to_save or []))
    for task, name in names.items():
        config = tuner.peft_config[name]
        if getattr(config, "peft_type", None) != tuner.peft_config[first].peft_type:
            raise ValueError(f"Graft {name!r} (task {task!r}) is not a graft adapter.")
        if sorted(set(config.modules_to_save or [])) != reference:
            raise ValueError(
                f"Graft {name!r} (task {task!r}) has another layout: its heads stored whole (modules_to_save) are "
                f"{sorted(set(config.modules_to_save or []))}, graft {first!r} (task {first_task!r}) has {reference}."
            )
        if tuner.region_learners(name):
            raise ValueError(f"Graft {name!r} (task {task!r}) is still learning its region: harden_region() first.")
        for module, layer in layers.items() if base else ():
            indices, _ = layer.entries(name)
            recorded = config.base_checksum.get(module)
            if indices.numel() and recorded and _base_checksum(layer, module, indices, checked) != recorded:
                raise ValueError(
                    f"Graft {name!r} (task {task!r}) was made from a different base model: its recorded checksum of "
                    f"theta_pre at its entries of {module!r} differs from this model's values. Merge only grafts of "
                    "one pre-trained model."
                )
    return checked


def _base_checksum(layer: GraftLayer, module: str, indices: torch.Tensor, checked: dict) -> str:
    """``layer.base_checksum(indices)``, read again only for other indices than the last computed for ``module`` (in
    ``checked``): full grafts hold the same entries, and their union is them too."""
    last = checked.get(module)
    if last is None or last[0].numel() != indices.numel() or not torch.equal(last[0], indices):
        checked[module] = (indices, layer.base_checksum(indices))
    return checked[module][1]


# ---------------------------------------------------------------------------------------------------- merging
class TaskVectorStack:
    """The task vectors of a set of loaded grafts, stacked once for many merges of them
    (``merge_grafts(..., stack=stack)``): per graft layer, the union of the grafts' flat indices, their values stacked
    ``(num_grafts, n)`` (NaN where a graft has no entry) and theta_ft where a graft stores it exactly (NaN elsewhere).

    It also keeps, for the global rules, the task vectors as each rule trims them before weighting (TIES's top
    ``density`` and elected signs, DARE's drops, Consensus's masks: :func:`~peft_graft.merge_rules.trim`), for the
    last :attr:`TRIMS_KEPT` settings of density, seed and masks: a grid over the weights at one density trims once.
    Memory: the stacked values, theta_ft where stored exactly and, once a global rule asked for them, the values with
    0 for NaN take 4 bytes each per stacked value (``num_grafts x`` the union of entries); each kept trim 2 more;
    the columns where a graft stores theta_ft exactly, once a merge asked for them, 8 more per graft each.

    It records a checksum of each graft's entries per layer and of the base model's values at their union, and every
    merge given the stack compares them again (a write through ``.data`` moves no version counter): a stack whose
    grafts' entries or base values have changed since (a region set again, values written in place, an adapter deleted
    and loaded with others) is refused, naming the graft or layer; build the stack again. Entries held anew but
    unchanged (a packed adapter unpacked by a forward) are accepted. (The base is checked against each graft's
    recorded theta_pre once, when the stack is built: one checksum of the union then stands for them.)
    """

    TRIMS_KEPT = 8

    def __init__(
        self,
        model: PeftModel,
        grafts: Mapping[str, str] | Sequence[str],
        exclude: Region | None = None,
        *,
        _one_merge: bool = False,
    ):
        tuner = _graft_tuner(model)
        self.names = _graft_names(grafts)
        missing = [name for name in self.names.values() if name not in tuner.peft_config]
        if missing:
            raise ValueError(f"A TaskVectorStack is built from loaded adapters; {missing} are not loaded in the model.")
        if exclude is not None and not isinstance(exclude, Region):
            raise TypeError(f"exclude must be a Region, got {type(exclude).__name__}.")
        checked = _check_grafts(tuner, self.names)
        self.model, self.exclude, self._one_merge = model, exclude, _one_merge
        # what check() compares on every later merge; merge_grafts' own stack for one merge needs none of it
        layers = {} if _one_merge else tuner.graft_layers()
        self.digests = {(module, name): _digest(tuner, module, name) for module in layers
                        for name in self.names.values()}  # fmt: skip
        unions = {module: _union(layer, list(self.names.values())) for module, layer in layers.items()}
        self.bases = {module: (indices, _base_checksum(layers[module], module, indices, checked))
                      for module, indices in unions.items() if indices.numel()}  # fmt: skip
        self.layers = _stacked_task_vectors(tuner, list(self.names.values()), exclude, unions)
        self._flat: torch.Tensor | None = None
        self._taus: torch.Tensor | None = None
        self._trims: OrderedDict[tuple, tuple] = OrderedDict()
        self._exact: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._bounds: dict[str, dict[str, float]] = {}

    @property
    def modules(self) -> list[str]:
        return list(self.layers)

    @property
    def flat(self) -> torch.Tensor:
        """The task vectors over the union of entries, ``(num_grafts, n)``, NaN where a graft has no entry."""
        if self._flat is None:
            self._flat = torch.cat([self.layers[m][1] for m in self.layers], dim=1)
        return self._flat

    @property
    def present(self) -> torch.Tensor:
        """Where each graft has an entry, ``(num_grafts, n)``."""
        return ~torch.isnan(self.flat)

    @property
    def taus(self) -> torch.Tensor:
        """The task vectors over the union of entries, ``(num_grafts, n)``, 0 where a graft has no entry."""
        if self._taus is None:
            self._taus = torch.nan_to_num(self.flat, nan=0.0)
        return self._taus

    def base_bounds(self, module: str) -> dict[str, float]:
        """Per stored tensor of ``module``: the largest ``|theta_pre|`` (as fp32, as ``GraftLayer.base_values`` reads
        it) at the stacked entries, found once per stack; every merge's :meth:`check` has compared the base values
        there with the stack's checksum of them before a merge uses it (:func:`_check_finite`)."""
        if module not in self._bounds:
            layer, indices = self.model.base_model.model.get_submodule(module), self.layers[module][0]
            values = layer.base_values(indices).abs()
            self._bounds[module] = {attr: float(values[position].max()) for attr, _, position in
                                    layer.space.split(indices)}  # fmt: skip
        return self._bounds[module]

    def exact_columns(self, module: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``module``'s stacked columns where some graft stores theta_ft exactly, and the stacked values and theta_ft
        there, ``(columns, (num_grafts, c), (num_grafts, c))``: the only columns whose merged entry can be stored
        exactly (:func:`~peft_graft.tuner.model._exact_after_combining` picks no other), found once per stack."""
        if module not in self._exact:
            _, rows, exact = self.layers[module]
            columns = (~torch.isnan(exact)).any(0).nonzero().squeeze(1)
            self._exact[module] = (columns, rows[:, columns], exact[:, columns])
        return self._exact[module]

    def trimmed(self, rule: str, options: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:func:`~peft_graft.merge_rules.trim` of the task vectors for ``rule`` and its checked ``options``."""
        consensus = (options["consensus_k"], options["tall_lambda"]) if rule in CONSENSUS_RULES else None
        seed = options["seed"] if rule in DARE_RULES else None
        method = options["majority_sign_method"] if rule in SIGN_RULES else None
        key = (rule, options["density"], seed, method, consensus)
        if key not in self._trims:
            self._trims[key] = trim(self.taus, rule, *key[1:])
            while len(self._trims) > self.TRIMS_KEPT:
                self._trims.popitem(last=False)
        self._trims.move_to_end(key)
        return self._trims[key]

    def check(self, model: PeftModel, names: dict[str, str], exclude: Region | None) -> None:
        """Refuse this stack for a merge of other grafts, another model or exclude, or grafts changed since."""
        if self._one_merge:
            raise ValueError("This TaskVectorStack was built by merge_grafts for one merge: build your own.")
        if model is not self.model:
            raise ValueError("The TaskVectorStack was built on another model: build one on this model.")
        if list(names.items()) != list(self.names.items()):  # rows in build order: weights follow the merge's order
            raise ValueError(f"The TaskVectorStack holds the grafts {self.names}, the merge asks for {names}: pass the "
                             "same grafts (task -> adapter, in the same order) or build another stack.")  # fmt: skip
        if (exclude is None) != (self.exclude is None) or (exclude is not None and exclude != self.exclude):
            raise ValueError("The TaskVectorStack was built with another exclude: build it with this one.")
        tuner = _graft_tuner(model)
        _check_grafts(tuner, names, base=False)
        for key, digest in self.digests.items():
            if _digest(tuner, *key) != digest:
                task = next(t for t, n in names.items() if n == key[1])
                raise ValueError(
                    f"Graft {key[1]!r} (task {task!r}) changed in {key[0]!r} since the TaskVectorStack was built: "
                    "its stacked task vector is stale. Build the stack again (TaskVectorStack(model, grafts))."
                )
        for module, (indices, checksum) in self.bases.items():
            if tuner.model.get_submodule(module).base_checksum(indices) != checksum:
                raise ValueError(
                    f"The base model's values at the grafts' entries of {module!r} changed since the TaskVectorStack "
                    "was built: build the stack again (TaskVectorStack(model, grafts)), which checks them against "
                    "each graft's recorded theta_pre."
                )


def _digest(tuner: GraftModel, module: str, name: str) -> str:
    """A checksum of one graft's entries in one layer (indices, fp32 values, exact entries), however they are held, and
    of the theta_pre its config records there (the base is checked against it only when the stack is built). Indices
    and positions are hashed in the dtype they are held in, without a copy: every way of holding them keeps the
    layer's index dtype (packed, unpacked, loaded, set), and the same entries held in another would be refused as a
    change, never missed."""
    layer = tuner.model.get_submodule(module)
    if layer.learner(name) is not None:
        return "learning"  # refused by the merge's checks anyway
    indices, values = layer.entries(name)
    positions, targets = layer.exact_entries(name)
    parts = {"indices": indices, "values": values.float(), "positions": positions, "targets": targets.float()}
    recorded = {"base_checksum": str(tuner.peft_config[name].base_checksum.get(module))}
    return state_checksum({k: v.detach().cpu().contiguous() for k, v in parts.items()}, recorded)


def _union(layer: GraftLayer, names: list[str]) -> torch.Tensor:
    """The sorted union of the grafts' flat indices in ``layer``: a presence map, linear in the layer's size (a sort,
    ``torch.unique``, and a binary search per graft took most of a merge's time on full fine-tunes)."""
    present = torch.zeros(layer.num_stored, dtype=torch.bool)
    for name in names:
        present[layer.entries(name)[0].to(torch.int64).cpu()] = True
    return present.nonzero().squeeze(1)


def _graft_names(grafts: Mapping[str, str] | Sequence[str]) -> dict[str, str]:
    """Task -> source from ``grafts``; a graft given twice is refused, naming it."""
    if isinstance(grafts, str) or not isinstance(grafts, (Mapping, Sequence)):
        raise TypeError(f"grafts must map task names to adapters/folders, or list adapter names; got {grafts!r:.100}.")
    sources = list(grafts.values()) if isinstance(grafts, Mapping) else list(grafts)
    twice = sorted({str(s) for s in sources if sources.count(s) > 1})
    if twice:
        raise ValueError(f"grafts names {twice} more than once: each graft merges once; give each task its own graft.")
    return dict(grafts) if isinstance(grafts, Mapping) else {name: name for name in grafts}


def task_vector_norms(
    model: PeftModel, grafts: Mapping[str, str] | Sequence[str] | None = None, *, stack: TaskVectorStack | None = None
) -> dict[str, dict[str, float]]:
    """Per task: the L2 norm of its task vector in all (``"total"``) and per layer type (each tensor's name without its
    block number, e.g. ``"encoder.layer.attention.self.query.weight"``). Norms that differ much between tasks are
    WUDI's known failure (its loss weighs each task by ``1 / ||tau_t||^2`` per matrix). Give loaded ``grafts`` or a
    ``stack`` of them."""
    if stack is None:
        if grafts is None:
            raise ValueError("task_vector_norms needs grafts (loaded adapter names) or a TaskVectorStack.")
        stack = TaskVectorStack(model, grafts, _one_merge=True)
    tuner = _graft_tuner(stack.model)
    squares: dict[str, torch.Tensor] = {}
    for module, (indices, rows, _) in stack.layers.items():
        for attr, _, position in tuner.model.get_submodule(module).space.split(indices):
            kind = layer_type(f"{module}.{attr}")
            part = torch.nan_to_num(rows[:, position], nan=0.0).double().square().sum(1)
            squares[kind] = squares.get(kind, torch.zeros(len(stack.names), dtype=torch.float64)) + part
    total = sum(squares.values(), torch.zeros(len(stack.names), dtype=torch.float64))
    return {task: {"total": float(total[row].sqrt()), **{k: float(v[row].sqrt()) for k, v in squares.items()}}
            for row, task in enumerate(stack.names)}  # fmt: skip


def _stacked_task_vectors(tuner: GraftModel, names: list[str], exclude: Region | None, unions: dict | None = None):
    """Per graft layer: the union of the grafts' flat indices (``unions``' where given), their values stacked
    ``(num_grafts, n)`` (NaN where a graft has no entry) and theta_ft where a graft stores it exactly (NaN
    elsewhere)."""
    layout = build_layout(tuner.model) if exclude is not None else None
    out = {}
    for module, layer in tuner.graft_layers().items():
        entries = [layer.entries(name) for name in names]
        indices = unions[module] if unions else _union(layer, names)  # and each graft's columns by a lookup below
        if exclude is not None and indices.numel():
            keep = torch.ones(indices.numel(), dtype=torch.bool)
            for attr, local, position in layer.space.split(indices):
                excluded = exclude.get(layout.by_site[(module, attr)].name)
                if excluded is not None:
                    keep[position] = ~torch.isin(local.to(torch.int64).cpu(), excluded)
            indices = indices[keep]
        if indices.numel() == 0:
            continue
        stacked = torch.full((len(names), indices.numel()), torch.nan)
        exact = torch.full_like(stacked, torch.nan)
        column_of = None
        for row, (idx, val) in enumerate(entries):
            positions, targets = layer.exact_entries(names[row])
            positions = positions.to(torch.int64).cpu()
            if exclude is None and idx.numel() == indices.numel():  # the union itself (a full graft): entry i, column i
                stacked[row] = val.detach().float().cpu()
                exact[row, positions] = targets.float().cpu()
                continue
            if column_of is None:
                small = torch.int32 if layer.num_stored < 2**31 else torch.int64  # int32: half the map's memory
                column_of = torch.full((layer.num_stored,), -1, dtype=small)
                column_of[indices] = torch.arange(indices.numel(), dtype=small)
            columns = column_of[idx.to(torch.int64).cpu()].to(torch.int64)
            found = columns >= 0
            stacked[row, columns[found]] = val.detach().float().cpu()[found]
            kept = found[positions]
            exact[row, columns[positions[kept]]] = targets.float().cpu()[kept]
        out[module] = (indices, stacked, exact)
    return out


def _merged_entries(tuner: GraftModel, stack: TaskVectorStack, rule: str, options: dict, grams):
    """Per graft layer: ``(indices, merged values, exact entries)`` of the merged body."""
    stacked, modules = stack.layers, stack.modules
    if not modules:
        raise ValueError(f"The grafts {list(stack.names.values())} hold no entries to merge (after exclude).")
    if rule in TENSOR_RULES:
        return _tensor_merged_entries(tuner, stack, rule, options, grams)
    sizes = [stacked[m][0].numel() for m in modules]
    flat, present = stack.flat, stack.present  # the task vectors over the union of entries
    density, weights = options["density"], torch.tensor(options["weights"] or [])
    if rule == "stitch":
        values, keep = _combine(flat, "average"), present.any(0)
    elif rule == "stitch_dataless":
        kept = torch.stack([top_magnitude(tau, density) for tau in stack.taus]) & present
        values = _combine(torch.where(kept, flat, torch.nan), "average")
        keep = kept.any(0)
        values = torch.nan_to_num(values, nan=0.0)
    else:
        values = combine(stack.taus, weights, stack.trimmed(rule, options), rule, density)
        keep = values != 0
    if options.get("scale", 1.0) != 1.0 or "lines" in options:
        factors = torch.full((len(modules),), float(options.get("scale", 1.0)))
        if "lines" in options:
            per_module = lines_scales(tuner.graft_layers(), *options["lines"])
            factors = torch.tensor([per_module[m] for m in modules])
        values = values * factors.repeat_interleave(torch.tensor(sizes))
        keep = keep & (values != 0)
    out = {}
    for module, part_values, part_keep in zip(modules, values.split(sizes), keep.split(sizes), strict=True):
        where = part_keep.nonzero().squeeze(1)  # once: each boolean index of part_keep would find them again
        if where.numel():
            indices = stacked[module][0]
            columns, rows, exact = stack.exact_columns(module)  # the only columns it can pick
            picked = part_keep[columns]
            unreachable = _exact_after_combining(rows[:, picked], exact[:, picked], part_values[columns][picked],
                                                 indices[columns][picked])  # fmt: skip
            out[module] = (indices[where], part_values[where].float(), unreachable)
    if not out:
        raise ValueError(f"rule {rule!r} with {options} changes no entry: raise density or the weights.")
    return out


def _tensor_merged_entries(tuner: GraftModel, stack: TaskVectorStack, rule: str, options: dict, grams) -> dict:
    """The rules on whole tensors (:data:`TENSOR_RULES`): each stored tensor's task vectors made dense (0 off a graft's
    region), merged by :mod:`peft_graft.merge_rules`; the merged body holds every entry the rule changed (a matrix
    rule changes whole matrices), never one of ``exclude``."""
    layout = build_layout(tuner.model)
    out = {}
    for module, (indices, rows, exact) in stack.layers.items():
        layer = tuner.model.get_submodule(module)
        parts = []
        for attr, local, position in layer.space.split(indices):
            parameter = layout.by_site[(module, attr)].parameter
            taus = torch.zeros(rows.shape[0], parameter.numel())
            taus[:, local] = torch.nan_to_num(rows[:, position], nan=0.0)
            taus = taus.reshape(rows.shape[0], *parameter.shape)
            merged = _merge_tensor(rule, options, taus, layer, module, attr, grams, list(stack.names)).reshape(-1)
            keep = merged != 0
            excluded = None if stack.exclude is None else stack.exclude.get(layout.by_site[(module, attr)].name)
            if excluded is not None:
                keep[excluded.to(torch.int64)] = False
            where = keep.nonzero().squeeze(1)
            global_indices = where + layer.space.start(attr)
            at_union = merged[local]
            picked = keep[local]
            unreachable = _exact_after_combining(rows[:, position][:, picked], exact[:, position][:, picked],
                                                 at_union[picked], indices[position][picked])  # fmt: skip
            parts.append((global_indices, merged[where].float(), unreachable))
        if any(p[0].numel() for p in parts):
            exact_indices, exact_values = (torch.cat([p[2][i] for p in parts]) for i in range(2))
            out[module] = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                           (exact_indices, exact_values))  # fmt: skip
    if not out:
        raise ValueError(f"rule {rule!r} changes no entry: the grafts' task vectors are 0 (after exclude).")
    return out


def _merge_tensor(rule, options, taus, layer, module, attr, grams, tasks) -> torch.Tensor:
    """One stored tensor's merged task vector by a tensor rule: WUDI on matrices, RegMean on linear weights, the mean
    of the task vectors elsewhere (as the references treat those tensors)."""
    if rule in ("wudi", "wudi_adam") and taus.dim() == 3:
        if rule == "wudi":
            return wudi_closed_form(taus)
        return wudi_adam(taus, options["wudi_steps"], options["wudi_lr"])
    if rule == "regmean" and attr == "weight" and isinstance(layer.base_layer, nn.Linear):
        matrices = []
        for task in tasks:
            gram = grams[task].get(module)
            if gram is None or tuple(gram.shape) != (taus.shape[2], taus.shape[2]):
                found = "none" if gram is None else f"one of shape {tuple(gram.shape)}"
                raise ValueError(
                    f"rule 'regmean': grams[{task!r}] has {found} for linear layer {module!r}, which needs "
                    f"({taus.shape[2]}, {taus.shape[2]}): collect them with peft_graft.input_statistics.input_grams."
                )
            matrices.append(gram.detach().float().cpu())
        try:
            return regmean(taus, matrices, options["regmean_alpha"])
        except torch.linalg.LinAlgError as error:
            raise ValueError(
                f"rule 'regmean': the summed Gram matrices of {module!r} are singular ({error}); use a regmean_alpha "
                "below 1 or more inputs per task."
            ) from error
    return mean_task_vector(taus)


def rule_options(rule, tasks, lines, scale, grams, regmean_alpha, wudi_steps, wudi_lr) -> dict:
    """The checked options of the newer rules (LiNeS, the stitch's scale, RegMean, WUDI) that ``rule`` takes, as saved
    with the merge; an option given to a rule that does not take it is refused."""
    out: dict = {}
    if lines is not None:
        if rule not in LINES_RULES:
            raise ValueError(f"rule {rule!r} takes no lines (LiNeS scaling is for {LINES_RULES}).")
        if not (isinstance(lines, Sequence) and len(lines) == 2 and all(_is_finite(v) for v in lines)):
            raise ValueError(f"lines must be (alpha, beta), two finite numbers, got {lines!r}.")
        out["lines"] = [float(v) for v in lines]
    if scale is not None:
        if rule not in STITCH_RULES:
            raise ValueError(f"rule {rule!r} takes no scale (only {STITCH_RULES} do; the others have weights).")
        if not _is_finite(scale):
            raise ValueError(f"scale must be a finite number, got {scale!r}.")
        out["scale"] = float(scale)
    if rule == "regmean":
        if not isinstance(grams, Mapping) or sorted(grams) != sorted(tasks):
            got = sorted(grams) if isinstance(grams, Mapping) else type(grams).__name__
            raise ValueError(f"rule 'regmean' needs grams: task -> {{linear layer: Gram matrix}} for each of {tasks}, "
                             f"got {got}; collect them with peft_graft.input_statistics.input_grams.")  # fmt: skip
        if not _is_finite(regmean_alpha) or not 0.0 <= regmean_alpha <= 1.0:
            raise ValueError(f"regmean_alpha must be a number in [0, 1], got {regmean_alpha!r}.")
        out["regmean_alpha"] = float(regmean_alpha)
    elif grams is not None or regmean_alpha != 0.95:
        raise ValueError(f"rule {rule!r} takes no grams/regmean_alpha (only 'regmean' does).")
    if rule == "wudi_adam":
        if isinstance(wudi_steps, bool) or not isinstance(wudi_steps, int) or wudi_steps < 0:
            raise ValueError(f"wudi_steps must be an int >= 0, got {wudi_steps!r}.")
        if not _is_finite(wudi_lr) or wudi_lr <= 0:
            raise ValueError(f"wudi_lr must be a finite number > 0, got {wudi_lr!r}.")
        out.update(wudi_steps=wudi_steps, wudi_lr=float(wudi_lr))
    elif (wudi_steps, wudi_lr) != (400, 1e-5):
        raise ValueError(f"rule {rule!r} takes no wudi_steps/wudi_lr (only 'wudi_adam' does).")
    return out


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < float("inf")


def _consensus_options(rule: str, count: int, consensus_k: object, tall_lambda: object) -> dict:
    if rule not in CONSENSUS_RULES:
        if (consensus_k, tall_lambda) != (2, 1.0):
            raise ValueError(f"rule {rule!r} takes no consensus_k/tall_lambda (only {CONSENSUS_RULES} do).")
        return {}
    if isinstance(consensus_k, bool) or not isinstance(consensus_k, int) or not 1 <= consensus_k <= count:
        raise ValueError(f"consensus_k must be an int in [1, {count}] (the number of grafts), got {consensus_k!r}.")
    if isinstance(tall_lambda, bool) or not isinstance(tall_lambda, (int, float)) or not 0 <= tall_lambda < torch.inf:
        raise ValueError(f"tall_lambda must be a finite number >= 0, got {tall_lambda!r}.")
    return {"consensus_k": consensus_k, "tall_lambda": float(tall_lambda)}


def _check_finite(
    tuner: GraftModel, merged: dict, rule: str, options: dict, bounds: Callable[[str], dict] | None = None
) -> None:
    """Refuse a merge whose merged parameters are not finite in the model's dtype (an fp16 model holds up to 65,504),
    or so large that the sum of their squares overflows float32 (a norm or dot product of them would: the merged
    model's outputs would be inf or NaN).

    ``bounds``: module -> stored tensor -> the largest ``|theta_pre|`` at any merged entry (a stack's
    :meth:`TaskVectorStack.base_bounds`). A tensor whose merged parameters that bound and the largest merged value show
    to pass is not read entry by entry (:func:`_within`); any other is."""
    limit = torch.finfo(torch.float32).max
    for module, (indices, values, _) in merged.items():
        layer = tuner.model.get_submodule(module)
        known, theta = None if bounds is None else bounds(module), None
        for attr, _, position in layer.space.split(indices):
            dtype = getattr(layer.base_layer, attr).dtype
            dtype = dtype if torch.finfo(dtype).max < limit else torch.float32  # the narrower of the two
            if known is not None and _within(known[attr], values[position], dtype, limit):
                continue
            if theta is None:
                theta = layer.base_values(indices).double() + values.double()
            part = theta[position]
            if not torch.isfinite(part.to(dtype)).all() or part.square().sum() > limit:
                fix = "use smaller weights (peft's default is 1.0)" if options["weights"] else "a graft is corrupt"
                raise ValueError(
                    f"rule {rule!r} with weights {options['weights']} gives merged values of {module}.{attr} up to "
                    f"{part.abs().max().item():.3g} (checked in {dtype}, which holds up to "
                    f"{torch.finfo(dtype).max:.3g}): the merged model's outputs would be inf or NaN; {fix}."
                )


def _within(base_bound: float, values: torch.Tensor, dtype: torch.dtype, limit: float) -> bool:
    """Whether merged parameters ``theta_pre + values`` (summed in float64, as :func:`_check_finite` does) with
    ``|theta_pre| <= base_bound`` surely pass its checks: each is at most ``m = base_bound + max|values|`` (float64
    rounding is monotone), which ``dtype`` holds, and the float64 sum of their squares is at most ``n m^2`` times
    ``(1 + 2^-53)^n``, under half of ``limit`` here. NaN or inf anywhere answers False."""
    largest = base_bound + float(values.abs().max())
    return largest <= torch.finfo(dtype).max and largest * largest * values.numel() * 2 <= limit


def _add_merged_adapter(tuner: GraftModel, names: list[str], adapter_name: str, merged: dict, rule: str) -> None:
    """Add the hard adapter ``adapter_name`` with the merged entries and a head copy (the first graft's head)."""
    config = copy.copy(tuner.peft_config[names[0]])
    config.inference_mode, config.learn_region = True, False
    config.region_provenance = {
        "strategy": "union",
        "learned": False,
        "kept": "combination",
        "combined_from": list(names),
        "combination": rule,
    }
    wrappers = [
        w for w in tuner.model.modules() if isinstance(w, ModulesToSaveWrapper) and names[0] in w.modules_to_save
    ]
    tuner.peft_config[adapter_name] = config
    try:
        for module, (indices, values, unreachable) in merged.items():
            layer = tuner.model.get_submodule(module)
            layer.set_region(adapter_name, indices, values, unreachable)
            layer.graft_values[adapter_name].requires_grad_(False)
        for wrapper in wrappers:
            wrapper.update(adapter_name)
            wrapper.modules_to_save[adapter_name].load_state_dict(wrapper.modules_to_save[names[0]].state_dict())
            wrapper.modules_to_save[adapter_name].requires_grad_(False)
        _record_layout(tuner.model, config, adapter_name)
    except BaseException:
        del tuner.peft_config[adapter_name]
        for layer in tuner.graft_layers().values():
            layer.delete_adapter(adapter_name)
        for wrapper in wrappers:
            if adapter_name in wrapper.modules_to_save:
                del wrapper.modules_to_save[adapter_name]
                wrapper._adapters.discard(adapter_name)
        raise
    tuner.model.peft_config = tuner.peft_config


def _graft_layers(model: PeftModel) -> dict[str, GraftLayer]:
    return _graft_tuner(model).graft_layers()


def _head_copies(model: PeftModel, adapter_name: str) -> dict[str, torch.Tensor]:
    """An adapter's heads stored whole: ``"<module>.<tensor>"`` -> its ``modules_to_save`` copy's parameter."""
    out = {}
    for path, wrapper in model.base_model.model.named_modules():
        if isinstance(wrapper, ModulesToSaveWrapper) and adapter_name in wrapper.modules_to_save:
            for name, param in wrapper.modules_to_save[adapter_name].named_parameters():
                out[f"{path}.{name}"] = param
    return out


__all__ = ["MERGE_RULES", "MergedGraft", "TaskVectorStack", "merge_grafts", "task_vector_norms"]
