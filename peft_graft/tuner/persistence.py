"""Persistence of graft adapters: atomic saves, checked loads, the model card, ``push_to_hub``.

peft writes adapter files in place and offers no hook around saving or loading, so the package wraps
``PeftModel.save_pretrained``, ``PeftModel.load_adapter``, ``PeftModel.push_to_hub`` and transformers'
``load_adapter`` (see :mod:`.wrappers`, installed by ``peft_graft/__init__.py``); models without a graft adapter take
the original path. ``PeftConfig.from_json_file`` and ``PeftConfig._get_peft_type`` are wrapped
too: a malformed ``adapter_config.json`` or an unknown ``peft_type`` is a ``ValueError`` naming the file, not a raw
``KeyError`` or ``JSONDecodeError``.

- ``save_pretrained`` holds an advisory lock file beside the destination (:func:`folder_lock`), so that saves of one
  folder from several processes take turns. It saves into a staging folder beside the destination, then moves each
  file into place with ``os.replace`` (atomic on one filesystem), the adapter configs last, with SIGINT/SIGTERM held
  off during the moves and hard links to the replaced files kept until all are in place. A save killed part way (even
  by SIGKILL) is finished or undone by the next save or load of that folder (:func:`recover_interrupted_save`), which
  also removes the staging folders of dead processes: the folder holds the previous adapter or the new one, never a
  mix.
- Every file a load reads is checked first (:mod:`peft_graft._files`): a config or weights file that is a folder, a
  device or a FIFO (or a link to one) is a ``ValueError`` naming it, never read without end or waited on.
- A saved config records a local base or fine-tuned model (``base_model_name_or_path``,
  ``finetuned_model_name_or_path``) relative to the adapter's folder, and reading it resolves the path again: no
  machine's path is saved (:func:`relative_reference`).
- The config of a saved graft records the sha256 of its weights file (``weights_checksum``); loading a local graft
  whose file does not match it is a ``ValueError``.
- A failed ``load_adapter`` of a graft (a truncated or corrupt file, entries that do not fit the model, the wrong
  base) removes the half-added adapter again, so the model is left as it was, and a corrupt safetensors file is
  reported as a ``ValueError`` naming the folder.
- The model card (:mod:`.card`) replaces peft's empty template with what the graft is, its base model, how its
  region was found, where its entries sit, its run's metrics and how to load it; it keeps peft's metadata
  (``library_name: peft``, ``base_model``, peft's tags) and gains the tags ``graft`` and ``skill-localization``.
- transformers' ``push_to_hub`` replaces the saved card with a generic ``library_name: transformers`` one; for graft
  adapters the folder written by ``save_pretrained`` is uploaded as it is, with ``HfApi.upload_folder``. A failed
  push (no network, no login) is an ``OSError`` chaining the Hub's error that names the repository, the step that
  failed and the local folder the graft was saved in, and says how to retry the upload.
"""

from __future__ import annotations

import filecmp
import functools
import inspect
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import safetensors
import safetensors.torch
import torch
from filelock import FileLock
from huggingface_hub import HfApi
from huggingface_hub.utils import HFValidationError, validate_repo_id
from peft import PeftConfig, PeftModel
from peft.utils.other import AuxiliaryTrainingWrapper
from safetensors import SafetensorError

from .._checksum import (
    CONFIG_NAME,
    VERSION_FIELD,
    WEIGHTS_NAME,
    check_format_version,
    check_integrity_fields,
    record_weights_checksum,
    verify_weights_checksum,
)
from .._files import check_file, is_local_path, open_file, read_file, read_json
from ..parameter_layout import PEFT_PREFIX
from ..sharding import is_sharded, refuse_sharded
from .card import card_location, pushing, write_graft_card
from .config import GRAFT_NAME, GRAFT_PREFIX
from .in_place import state_change
from .layer import GraftLayer, graft_state_modules
from .model import check_graft_state_dict, check_loaded_graft

STAGING, PREVIOUS = "saving", "previous"  # the hidden folders a save keeps beside its destination


def is_graft_model(model: PeftModel) -> bool:
    """Whether ``model`` (a ``PeftModel``) holds a graft adapter."""
    return any(str(c.peft_type).lower().endswith(GRAFT_NAME) for c in model.peft_config.values())


def wrap_save(original):
    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if is_graft_model(self) and kwargs.get("state_dict") is None:
            _refuse_sharded_graft(self)
        if not is_graft_model(self) or not kwargs.get("is_main_process", True):
            return original(self, save_directory, *args, **kwargs)
        if not kwargs.get("safe_serialization", args[0] if args else True):
            raise ValueError(
                "save_pretrained(safe_serialization=False) would write the graft as adapter_model.bin (a pickle), "
                "which peft_graft never loads: graft weights are saved as safetensors only. Drop the argument."
            )
        given_directory = os.fspath(save_directory)  # as the user named it: the card's load snippet names it so
        save_directory = os.path.abspath(given_directory)
        parent = os.path.dirname(save_directory)
        os.makedirs(parent, exist_ok=True)
        with folder_lock(save_directory):  # one save of a folder at a time, across threads and processes
            recover_interrupted_save(save_directory)
            staging = tempfile.mkdtemp(prefix=_side_prefix(save_directory, STAGING), dir=parent)
            try:
                existing_card = os.path.join(save_directory, "README.md")
                if os.path.isfile(existing_card):  # peft updates an existing card rather than replacing it
                    shutil.copy2(existing_card, staging)
                original(self, staging, *args, **kwargs)
                for rel, write in (_saved_beside.get() or {}).items():
                    write(os.path.join(staging, rel))
                for root, _, names in os.walk(staging):
                    if CONFIG_NAME in names:
                        adapter_folder = os.path.join(save_directory, os.path.relpath(root, staging))
                        # a push's folder is a temporary one: a local path relative to it would mean nothing
                        record_paths_relative(os.path.join(root, CONFIG_NAME), None if pushing() else adapter_folder)
                        record_weights_checksum(root)
                selected = kwargs.get("selected_adapters", args[1] if len(args) > 1 else None)
                write_graft_card(self, staging, given_directory, selected)
                _check_before_replacing(self, staging, given_directory)
                _move_into_place(staging, save_directory)
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    return save_pretrained


def _refuse_sharded_graft(model: PeftModel) -> None:
    """Saving reads the graft's own tensors whole: refused where FSDP2 shards or ZeRO-3 partitions them."""
    own = {id(param) for module in graft_state_modules(model) for param in module.parameters()}
    refuse_sharded(
        ((name, param) for name, param in model.named_parameters() if id(param) in own),
        "save_pretrained()",
        "save the graft before sharding the model, or shard it with the graft's own state left whole, as MaskTrainer "
        "does under FSDP2 (the graft layers' graft_values and graft_learning and the modules_to_save copies as "
        "fully_shard's ignored_params), and save from rank 0; or gather the state on every process "
        "(torch.distributed.checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
        "full_state_dict=True, cpu_offload=True))) and save it from rank 0: save_pretrained(path, state_dict=state).",
    )


_saved_beside: ContextVar[dict[str, Callable[[str], None]] | None] = ContextVar("graft_saved_beside", default=None)


@contextmanager
def saved_beside(writers: dict[str, Callable[[str], None]]):
    """Within this block, a graft's ``save_pretrained`` also writes each file ``writers[rel](path)`` at ``rel`` in
    the folder, staged and moved into place with the adapter's own files (e.g. a merged graft's task heads)."""
    token = _saved_beside.set(writers)
    try:
        yield
    finally:
        _saved_beside.reset(token)


def _check_before_replacing(model: PeftModel, staging: str, destination: str) -> None:
    """Run the loader's checks on each graft adapter staged for a save, so that a save never replaces a folder with a
    graft its own loader refuses (e.g. values a cast to bf16 changed): a ``ValueError`` naming the tensor, and the
    destination is left as it was."""
    for root, _, names in os.walk(staging):
        weights = os.path.join(root, WEIGHTS_NAME)
        if CONFIG_NAME not in names or not os.path.isfile(weights):
            continue
        raw = read_json(os.path.join(root, CONFIG_NAME), "adapter config")
        if not str(raw.get("peft_type", "")).lower().endswith(GRAFT_NAME):  # another method's adapter
            continue
        rel = os.path.relpath(root, staging)
        adapter_name = "default" if rel == os.curdir else rel  # peft saves other adapters in a sub-folder
        state_dict = safetensors.torch.load_file(weights)
        try:
            config = PeftConfig.from_pretrained(root)
            check_integrity_fields(root)
            verify_weights_checksum(root)
            check_graft_state_dict(model, config, state_dict, adapter_name)
        except ValueError as error:
            raise ValueError(
                f"save_pretrained({destination!r}) refused: adapter {adapter_name!r} would be saved as a graft its own "
                f"loader refuses ({error}). Nothing was written; the folder holds what it held before. Fix: "
                f"{_save_fix(raw, state_dict)}."
            ) from error
        previous = os.path.join(os.path.abspath(destination), rel, WEIGHTS_NAME)
        _refuse_heads_losing_precision(state_dict, previous, adapter_name, destination)


SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _refuse_heads_losing_precision(
    state_dict: dict[str, torch.Tensor], previous: str, adapter_name: str, destination: str
) -> None:
    """A save must not replace a head stored whole (``modules_to_save``) that the folder holds in a higher precision
    with a lower one (after ``model.to(torch.bfloat16)`` the fp32 head would be gone): a ``ValueError`` naming the
    head and how to save it elsewhere. Graft values are fp32 whatever the cast (``GraftLayer._apply``)."""
    if not os.path.isfile(previous):
        return
    try:
        with safetensors.safe_open(check_file(previous, "adapter weights file"), "pt") as handle:
            saved = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError):
        return  # the folder holds no readable graft: nothing to lose
    for key, tensor in sorted(state_dict.items()):
        before = SAFETENSORS_FLOATS.get(saved.get(key, ""))
        if f".{GRAFT_PREFIX}" in key or before is None or not tensor.is_floating_point():
            continue
        if torch.finfo(tensor.dtype).eps > torch.finfo(before).eps:
            raise ValueError(
                f"save_pretrained({destination!r}) refused: adapter {adapter_name!r} would replace its head tensor "
                f"{key.removeprefix(PEFT_PREFIX)!r} (stored whole, modules_to_save), saved there as {before}, with "
                f"{tensor.dtype} (the model was cast, e.g. model.to({tensor.dtype})): the {before} values would be "
                "lost. Nothing was written; the folder holds what it held before. Save the cast model into another "
                "folder, or delete this folder first to replace it knowingly."
            )


def _save_fix(raw_config: dict, state_dict: dict[str, torch.Tensor]) -> str:
    """How to fix a graft that its loader would refuse, from what was staged."""
    if not raw_config.get("grafted_modules"):
        return (
            "the graft has no entries (e.g. a learned region kept empty: the sign test kept region='empty'), and peft "
            "cannot load an adapter that targets no module; keep a non-empty region (start from a budgeted region "
            "such as region='movement', or harden_region(num_entries=...))"
        )
    wrong = sorted({str(t.dtype) for k, t in state_dict.items() if f".{GRAFT_PREFIX}" in k and "values" in k}
                   - {str(torch.float32)})  # fmt: skip
    if wrong:
        return (
            f"graft values are float32, these are {', '.join(wrong)} (a cast such as model.to(torch.bfloat16) changed "
            "them): cast them back with model.float() before saving"
        )
    return "the graft in memory is corrupt: rebuild or reload it before saving"


PATH_FIELDS = ("base_model_name_or_path", "finetuned_model_name_or_path")
"""The fields of a graft's config that may name a local folder: saved relative to the adapter's folder."""


def relative_reference(name: object, folder: str | None) -> object:
    """``name`` (a recorded base or fine-tuned model) as a saved config records it: a local path relative to
    ``folder`` (the adapter's folder; ``./x`` or ``../x``), so that no machine's path is saved and the graft and its
    base can move together; a Hub id (or nothing) as it is."""
    if not isinstance(name, str) or not is_local_path(name):
        return name
    if folder is None:
        return None
    relative = os.path.relpath(os.path.abspath(name), os.path.abspath(folder))
    return relative if relative.split(os.sep)[0] == os.pardir else os.path.join(os.curdir, relative)


def resolved_reference(name: object, folder: str) -> object:
    """``name`` as a config read from ``folder`` records it: one saved relative to the folder
    (:func:`relative_reference`) as the absolute path it names there, whether or not that folder exists (never left
    relative, where it would resolve against the working directory, perhaps to another model); anything else as it
    is."""
    if isinstance(name, str) and _is_relative(name):
        return os.path.normpath(os.path.join(os.path.abspath(folder), name))
    return name


def _is_relative(name: str) -> bool:
    """Whether ``name`` is in the form :func:`relative_reference` saves (``./x``, ``../x``)."""
    return name.replace("\\", "/").split("/")[0] in (os.curdir, os.pardir)


def record_paths_relative(config_path: str, folder: str | None) -> None:
    """Rewrite a staged graft config so that its local paths (:data:`PATH_FIELDS`) are relative to ``folder``, the
    adapter's destination (see :func:`relative_reference`); ``None`` (a push to the Hub): not recorded at all (the
    card names the folder)."""
    config = read_json(config_path, "adapter config")
    if not isinstance(config, dict) or str(config.get("peft_type", "")).lower() != GRAFT_NAME:
        return
    relative = {field: relative_reference(config.get(field), folder) for field in PATH_FIELDS if config.get(field)}
    if any(config[field] != value for field, value in relative.items()):
        with open(config_path, "w", encoding="utf-8") as handle:
            json.dump({**config, **relative}, handle, indent=2, sort_keys=True)


def folder_lock(destination: str) -> FileLock:
    """The advisory lock of a save folder: the file ``.<name>.lock`` beside it (as ``huggingface_hub`` locks its
    downloads). Saves hold it from start to end, so that two processes (or threads) saving into one folder take turns
    rather than leaving one graft's weights beside the other's config. The system drops it when its holder dies."""
    parent, name = os.path.split(os.path.abspath(os.fspath(destination)))
    return FileLock(os.path.join(parent, f".{name}.lock"))


def _check_local_folder(model_id, subfolder: str | None, config=None) -> None:
    """Before loading from a local folder: finish or undo a killed save, refuse pickled graft weights, graft tensors
    under another method's ``peft_type`` and missing integrity fields, verify the weights checksum. ``config``: the
    graft config the loader was given, if any."""
    check_local_adapter_paths(model_id, subfolder)
    if isinstance(model_id, (str, os.PathLike)) and os.path.isdir(model_id):
        recover_interrupted_save(os.path.abspath(os.fspath(model_id)))
        folder = os.path.join(os.fspath(model_id), subfolder or "")
        _refuse_pickled_graft(folder)
        _refuse_graft_tensors_of_another_method(folder)
        check_integrity_fields(folder, config if is_graft_config(config) else None)
        verify_weights_checksum(folder)


def check_local_adapter_paths(model_id, subfolder: str | None = None) -> None:
    """Check the local adapter paths before any loader reads them: a path (the folder, its config or weights) that
    exists as a symbolic link but cannot be resolved (a loop, a missing target) is a ``ValueError`` naming it (the
    loaders would take the folder for a Hub id), and so is a config or weights file that is not a regular file once
    links are resolved (a folder, a device such as ``/dev/zero``, a FIFO: :func:`~peft_graft._files.check_file`),
    which a loader would read without end, wait on forever, or report without its path."""
    if not isinstance(model_id, (str, os.PathLike)):
        return
    folder = os.path.join(os.fspath(model_id), subfolder or "")
    for path in (os.fspath(model_id), folder, os.path.join(folder, CONFIG_NAME), os.path.join(folder, WEIGHTS_NAME)):
        if os.path.islink(path) and not os.path.exists(path):
            raise ValueError(
                f"{path!r} is a symbolic link that cannot be resolved (a loop, or its target is missing), so the "
                "adapter cannot be read from there (nor is it a Hub id): fix or replace the link, or give the folder "
                "that holds the adapter."
            )
    if os.path.isdir(folder):
        check_file(os.path.join(folder, CONFIG_NAME), "adapter config", missing_ok=True)
        for name in (WEIGHTS_NAME, "adapter_model.bin"):
            check_file(os.path.join(folder, name), "adapter weights file", missing_ok=True)


def is_graft_config(config) -> bool:
    """Whether ``config`` (a peft config or None) is a graft's."""
    return config is not None and str(config.peft_type).lower().endswith(GRAFT_NAME)


def _corrupt_file_error(model_id, error: SafetensorError) -> ValueError:
    return ValueError(
        f"The graft weights in {os.fspath(model_id)!r} are truncated or corrupt ({error}): save or download the "
        "adapter again."
    )


def wrap_load(original):
    @functools.wraps(original)
    def load_adapter(self, model_id, adapter_name, *args, **kwargs):
        if is_graft_model(self):
            # ZeRO-3 partitioning the model as it loaded (zero.Init) is fine: the graft is built on the gathered model
            # and its own tensors stay whole; not once an engine partitioned those too.
            own = {id(param) for module in graft_state_modules(self) for param in module.parameters()}
            refuse_sharded(
                ((name, param) for name, param in self.named_parameters() if is_sharded(param) or id(param) in own),
                f"load_adapter({adapter_name!r})",
                "load every adapter before sharding the model (PeftModel.from_pretrained, then load_adapter on the "
                "whole model), then shard it (fully_shard, or the Trainer's fsdp/deepspeed settings); adapter "
                "tensors added to sharded layers would not take part in their gathering.",
            )
        # A graft model's forwards in other threads wait for the load; one from a hook is refused.
        with state_change("load_adapter()") if is_graft_model(self) else nullcontext():
            _check_local_folder(model_id, kwargs.get("subfolder"), self.peft_config.get(adapter_name))
            _refuse_taken_name(self, model_id, adapter_name, kwargs.get("subfolder"))
            out = _load_checked(self, model_id, adapter_name, *args, **kwargs)
            config = self.peft_config.get(adapter_name)
            if is_graft_config(config) and config.inference_mode and hasattr(self.base_model, "pack_adapter"):
                self.base_model.pack_adapter(adapter_name)  # loaded for inference: about its bytes in memory
            return out

    def _load_checked(self, model_id, adapter_name, *args, **kwargs):
        is_new = adapter_name not in self.peft_config
        try:
            return original(self, model_id, adapter_name, *args, **kwargs)
        except BaseException as error:  # any failure: leave the model as it was
            if not is_graft_config(self.peft_config.get(adapter_name)):
                raise
            if is_new and len(self.peft_config) > 1:  # the only adapter cannot be deleted
                self.delete_adapter(adapter_name)
            if isinstance(error, SafetensorError):
                raise _corrupt_file_error(model_id, error) from error
            if isinstance(error, KeyError):  # peft looks up the heads stored whole (modules_to_save) by name
                raise ValueError(
                    f"The graft weights of {os.fspath(model_id)!r} lack tensor {error.args[0]!r}: the file is "
                    "incomplete. Save or download the adapter again."
                ) from error
            raise

    return load_adapter


def _refuse_taken_name(model: PeftModel, model_id, adapter_name: str, subfolder: str | None) -> None:
    """Loading under the name of a graft the model holds loads into that adapter (peft keeps its config): new values
    of the same graft (the same entries per module) are loaded; another graft is a ``ValueError`` naming the adapter,
    before anything changes (it was a misleading error about the file's ``grafted_modules``)."""
    existing = model.peft_config.get(adapter_name)
    if not is_graft_config(existing) or not isinstance(model_id, (str, os.PathLike)):
        return
    try:
        saved = read_json(os.path.join(os.fspath(model_id), subfolder or "", CONFIG_NAME), "adapter config")
    except (OSError, ValueError):
        return  # not a local adapter folder (a Hub id): peft's checks of the file report it
    if not isinstance(saved, dict):
        return
    if saved.get("grafted_modules") != existing.grafted_modules or (saved.get("exact_entries") or {}) != (
        existing.exact_entries or {}
    ):
        raise ValueError(
            f"load_adapter({os.fspath(model_id)!r}, adapter_name={adapter_name!r}): this model already has an adapter "
            f"named {adapter_name!r} (adapters: {sorted(model.peft_config)}), and {os.fspath(model_id)!r} holds "
            "another graft. Pick another adapter_name, or delete that adapter first (model.delete_adapter("
            f"{adapter_name!r}); the only adapter cannot be deleted: load the new one under another name, then delete "
            "the old one). Nothing was loaded."
        )


def wrap_transformers_load(original):
    """transformers' ``PreTrainedModel.load_adapter`` (also behind ``from_pretrained`` of an adapter folder) copies
    the file into the layers itself: the same checks as peft's path, and the same rollback."""

    @functools.wraps(original)
    def load_adapter(
        self, peft_model_id=None, adapter_name=None, peft_config=None, adapter_state_dict=None, *args, **kwargs
    ):
        subfolder = kwargs.get("subfolder") or (kwargs.get("adapter_kwargs") or {}).get("subfolder")
        _check_local_folder(peft_model_id, subfolder)
        weights = os.path.join(os.fspath(peft_model_id or ""), subfolder or "", WEIGHTS_NAME)
        name = adapter_name if adapter_name is not None else "default"
        loaded = getattr(self, "_hf_peft_config_loaded", False)
        existing, active = (set(self.peft_config), self.active_adapters()) if loaded else (set(), [])

        def check_stored_tensors() -> None:
            """transformers casts what it copies: check the tensors as stored (dtypes included) where at hand."""
            state_dict = adapter_state_dict
            if state_dict is None and peft_model_id is not None and os.path.isfile(weights):
                state_dict = safetensors.torch.load(read_file(weights, "adapter weights file"))
            if state_dict is None:
                check_loaded_graft(self, name)
            else:
                check_graft_state_dict(self, self.peft_config[name], state_dict, name)

        try:
            info = original(self, peft_model_id, adapter_name, peft_config, adapter_state_dict, *args, **kwargs)
            if is_graft_config(self.peft_config.get(name)):
                missing = sorted(
                    k for k in getattr(info, "missing_keys", ()) if f".{GRAFT_PREFIX}" in k and k.endswith(f".{name}")
                )
                if missing:
                    raise ValueError(
                        f"The graft weights of {os.fspath(peft_model_id or 'adapter_state_dict')!r} lack "
                        f"{len(missing)} tensors its config records (e.g. {missing[0]!r}): it is incomplete. Save or "
                        "download the adapter again."
                    )
                check_stored_tensors()
                # transformers leaves a modules_to_save head of the new adapter inactive while its layers are active.
                self.set_adapter(self.active_adapters())
            return info
        except BaseException as error:
            config = self.peft_config.get(name) if getattr(self, "_hf_peft_config_loaded", False) else None
            if name in existing or not is_graft_config(config):
                raise
            explanation = None
            if isinstance(error, RuntimeError):  # transformers' own refusal (sizes): say what is wrong with the file
                try:
                    check_stored_tensors()
                except (ValueError, SafetensorError) as found:
                    explanation = found
            _remove_loaded_graft(self, name, active)
            if isinstance(explanation or error, SafetensorError):
                raise _corrupt_file_error(peft_model_id, explanation or error) from error
            if explanation is not None:
                raise explanation from error
            raise

    return load_adapter


def _remove_loaded_graft(model, adapter_name: str, previously_active: list[str]) -> None:
    """Undo a failed transformers ``load_adapter``. Done here because transformers' ``delete_adapter`` fails on a
    ``modules_to_save`` head then, and leaves graft layers without any adapter behind when it deletes the last one."""
    model.peft_config.pop(adapter_name, None)
    last = not model.peft_config
    if not last:
        model.set_adapter(previously_active)
    for name, module in list(model.named_modules()):
        if last and isinstance(module, (GraftLayer, AuxiliaryTrainingWrapper)):
            original = module.get_base_layer() if isinstance(module, GraftLayer) else module.original_module
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, original)
        elif isinstance(module, GraftLayer):
            module.delete_adapter(adapter_name)
        elif isinstance(module, AuxiliaryTrainingWrapper) and adapter_name in module.modules_to_save:
            module.delete_adapter(adapter_name, new_active_adapters=previously_active)
    if last:
        del model.peft_config
        model._hf_peft_config_loaded = False


GRAFT_ONLY_FIELDS = (
    "grafted_modules",
    "base_checksum",
    "base_fingerprint",
    "exact_entries",
    "format_version",
    "region_provenance",
)
"""Fields only a graft's adapter config holds."""


def _refuse_graft_tensors_of_another_method(folder: str) -> None:
    """A graft folder whose ``peft_type`` was changed to another method's would load as that method's adapter."""
    try:
        config = read_json(os.path.join(folder, CONFIG_NAME), "adapter config")
    except (OSError, ValueError):
        return
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    peft_type = str(config.get("peft_type")) if isinstance(config, dict) else ""
    if peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING or peft_type.lower() == GRAFT_NAME:
        return  # a graft, or a peft_type the config reader refuses
    weights, holds_graft = os.path.join(folder, WEIGHTS_NAME), False
    if check_file(weights, "adapter weights file", missing_ok=True):
        try:
            with safetensors.safe_open(weights, "pt") as handle:
                holds_graft = any(f".{GRAFT_PREFIX}indices" in key for key in handle.keys())  # noqa: SIM118
        except SafetensorError:
            return  # not readable: the loader reports it
    if holds_graft:
        raise ValueError(
            f"{os.path.join(folder, CONFIG_NAME)!r} names peft_type={config.get('peft_type')!r}, but "
            f"{WEIGHTS_NAME} holds graft tensors (graft_indices): the config was altered. A graft's peft_type is "
            "'GRAFT'. Save or download the adapter again."
        )


def _refuse_pickled_graft(folder: str) -> None:
    """A local graft folder must hold safetensors weights: peft would unpickle an ``adapter_model.bin`` instead."""
    try:
        config = read_json(os.path.join(folder, CONFIG_NAME), "adapter config")
    except (OSError, ValueError):
        return  # not a readable adapter folder: peft reports it
    peft_type = str(config.get("peft_type", "")) if isinstance(config, dict) else ""
    safetensors = os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))
    if (
        peft_type.lower() == GRAFT_NAME
        and not safetensors
        and os.path.isfile(os.path.join(folder, "adapter_model.bin"))
    ):
        raise ValueError(
            f"{folder!r} holds graft weights as adapter_model.bin (a pickle) and no adapter_model.safetensors: graft "
            "weights are only loaded from safetensors. Re-save the graft with save_pretrained."
        )


def wrap_torch_load(original):
    """peft's ``torch_load`` of adapter weights: refused for a pickled graft before unpickling, also one reached by Hub
    id (a local folder is checked before loading anyway, ``_check_local_folder``): its config was downloaded beside."""

    @functools.wraps(original)
    def torch_load(filename, *args, **kwargs):
        if isinstance(filename, (str, os.PathLike)):
            _refuse_pickled_graft(os.path.dirname(os.fspath(filename)))
        return original(filename, *args, **kwargs)

    return torch_load


SMALL_WEIGHTS_FILE = 64 * 2**20
"""Adapter weights files up to this size (bytes) are read whole by :func:`wrap_safe_load_file`."""


def wrap_safe_load_file(original):
    """peft's ``safe_load_file`` (safetensors' ``load_file``) of adapter weights: a small file loaded onto the CPU is
    read whole and parsed by ``safetensors.torch.load``, which gives the same tensors, because ``load_file`` (through
    ``safe_open``, safetensors 0.8) keeps about two small Python objects per tensor for good: about 11 KB per load of
    a graft of 0.01% of RoBERTa-base, so that a thousand loads (issue 28) would leak 11 MB. Other files and devices go
    to ``load_file``. Whatever the size, the file is opened by :func:`~peft_graft._files.open_file` first: a path
    that is not a regular file (a folder, ``/dev/zero``, a FIFO) is a ``ValueError`` naming it, never read without
    end or waited on."""

    @functools.wraps(original)
    def safe_load_file(filename, device="cpu", *args, **kwargs):
        if not isinstance(filename, (str, os.PathLike)):
            return original(filename, device, *args, **kwargs)
        with open_file(filename, "adapter weights file") as (handle, size):  # a regular file, or a ValueError
            if not args and not kwargs and str(device) == "cpu" and size <= SMALL_WEIGHTS_FILE:
                data = handle.read(size + 1)
                if len(data) == size:
                    return safetensors.torch.load(data)
        return original(filename, device, *args, **kwargs)

    return safe_load_file


def wrap_checkpoint_resolution(original):
    """transformers' ``_get_resolved_checkpoint_files``, which its ``load_adapter`` finds an adapter's weights with:
    a pickled graft's file is refused once found, before anything reads it."""

    @functools.wraps(original)
    def resolve(*args, **kwargs):
        files, metadata = original(*args, **kwargs)
        for file in files or ():
            if os.fspath(file).endswith(".bin"):
                _refuse_pickled_graft(os.path.dirname(os.fspath(file)))
        return files, metadata

    return resolve


def wrap_config_reader(original):
    """``PeftConfig.from_json_file``, which every loader reads a saved config with: errors that name the file."""

    @functools.wraps(original)
    def from_json_file(cls, path_json_file, **kwargs):
        check_file(path_json_file, "adapter config")  # a folder, device or FIFO: refused, not read or waited on
        try:
            loaded = original(cls, path_json_file, **kwargs)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{os.fspath(path_json_file)!r} is not valid JSON ({error}): save or download the adapter again."
            ) from error
        except TypeError as error:  # valid JSON, but not an object
            raise ValueError(
                f"{os.fspath(path_json_file)!r} is not a JSON object: not a peft adapter config."
            ) from error
        if not isinstance(loaded, dict):
            raise ValueError(f"{os.fspath(path_json_file)!r} is not a JSON object: not a peft adapter config.")
        peft_type = loaded.get("peft_type")
        from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

        if peft_type is not None and (not isinstance(peft_type, str) or peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING):
            raise ValueError(
                f"{os.fspath(path_json_file)!r} names peft_type={peft_type!r}, which no registered peft method knows. "
                "A graft needs `import peft_graft` before loading; another method needs the peft version or package "
                "that defines it."
            )
        if isinstance(peft_type, str) and peft_type.lower() == GRAFT_NAME:
            check_format_version(path_json_file, loaded.get(VERSION_FIELD))
            folder = os.path.dirname(os.fspath(path_json_file))
            for field in PATH_FIELDS:  # saved relative to the adapter's folder
                if field in loaded:
                    loaded[field] = resolved_reference(loaded[field], folder)
        graft_fields = [name for name in GRAFT_ONLY_FIELDS if loaded.get(name)]
        if peft_type is not None and graft_fields and peft_type.lower() != GRAFT_NAME:
            raise ValueError(
                f"{os.fspath(path_json_file)!r} names peft_type={peft_type!r} but holds a graft's fields "
                f"({', '.join(graft_fields)}): the config was altered. A graft's peft_type is 'GRAFT'; save or "
                "download the adapter again."
            )
        return loaded

    return from_json_file


def wrap_peft_type_reader(original):
    """``PeftConfig._get_peft_type``: a config without ``peft_type`` is a ``ValueError`` naming the folder."""

    @functools.wraps(original)
    def _get_peft_type(cls, model_id, **hf_hub_download_kwargs):
        check_local_adapter_paths(model_id, hf_hub_download_kwargs.get("subfolder"))
        try:
            return original(cls, model_id, **hf_hub_download_kwargs)
        except KeyError as error:
            raise ValueError(
                f"The {CONFIG_NAME} of {os.fspath(model_id)!r} has no 'peft_type' field: not a peft adapter."
            ) from error

    return _get_peft_type


def wrap_auto_load(original):
    """peft's ``AutoPeftModel*.from_pretrained`` loads the base model the adapter config names: a graft whose config
    names none (made on a model not loaded by name) is a ``ValueError`` at once, rather than retried downloads of
    ``None`` from the Hub."""

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        check_local_adapter_paths(pretrained_model_name_or_path, kwargs.get("subfolder"))
        bound = inspect.signature(original).bind(cls, pretrained_model_name_or_path, *args, **kwargs).arguments
        config = PeftConfig.from_pretrained(  # as peft reads it (it ignores ``config`` for the base model)
            pretrained_model_name_or_path, revision=bound.get("revision"), **bound.get("kwargs", {})
        )
        if is_graft_config(config) and not config.base_model_name_or_path:
            where = os.fspath(pretrained_model_name_or_path)
            raise ValueError(
                f"The graft {where!r} records no base model (base_model_name_or_path is "
                f"{config.base_model_name_or_path!r} in its {CONFIG_NAME}: it was made on a model not loaded by "
                f"name, or pushed from a local folder), so {cls.__name__} cannot load its base. Load the base model "
                f"yourself and the graft onto it: PeftModel.from_pretrained(base, {where!r}); or record the base's "
                "Hub id or folder in that field "
                "(set model.peft_config[adapter_name].base_model_name_or_path before saving)."
            )
        if is_graft_config(config):
            base, subfolder = config.base_model_name_or_path, kwargs.get("subfolder")
            _check_base_reachable(base, pretrained_model_name_or_path, subfolder, cls.__name__)
        return original(cls, pretrained_model_name_or_path, *args, **kwargs)

    return from_pretrained


def _check_base_reachable(base: str, graft, subfolder: str | None, loader: str) -> None:
    """A recorded base that names a local folder which is not there (nor could be a Hub id) is a ``ValueError`` naming
    it and how to load the graft onto its base, instead of the Hub's "Repo id must be in the form ..."."""
    if os.path.isdir(base) or (not is_local_path(base) and _could_be_hub_id(base)):
        return
    where = os.fspath(graft)
    relative = ""
    if _is_relative(base) and os.path.isdir(os.path.join(where, subfolder or "")):
        looked = os.path.normpath(os.path.join(os.path.abspath(where), subfolder or "", base))
        relative = f", relative to the graft's folder: {looked!r}"
    raise ValueError(
        f"The graft {where!r} records its base model as the local folder {base!r} (base_model_name_or_path in its "
        f"{CONFIG_NAME}{relative}), which does not exist here, so {loader} cannot load it. Load the base model "
        f"yourself and the graft onto it: PeftModel.from_pretrained(base, {where!r}); or put the base model's folder "
        "there, or record its Hub id in that field (set model.peft_config[adapter_name].base_model_name_or_path "
        "before saving)."
    )


def _could_be_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def wrap_push(original):
    @functools.wraps(original)
    def push_to_hub(self, repo_id, *args, commit_message=None, private=None, token=None, revision=None, **kwargs):
        if not is_graft_model(self):
            return original(
                self,
                repo_id,
                *args,
                commit_message=commit_message,
                private=private,
                token=token,
                revision=revision,
                **kwargs,
            )
        api, folder = HfApi(token=token), tempfile.mkdtemp(prefix="peft_graft-push-")
        try:  # the folder is saved even when the Hub cannot be reached, so that the upload can be retried
            repo_id, failure = api.create_repo(repo_id, private=private, exist_ok=True).repo_id, None
        except Exception as error:
            failure = error
        try:
            with card_location(repo_id):
                self.save_pretrained(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        try:
            if failure is not None:
                raise failure
            uploaded = api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                commit_message=commit_message or "Upload graft adapter",
                revision=revision,
                create_pr=kwargs.get("create_pr", False),
            )
        except Exception as error:
            step = "creating the repository" if error is failure else "uploading the folder"
            raise OSError(
                f"push_to_hub({repo_id!r}) failed {step}: {type(error).__name__}: {error}. The graft is saved locally "
                f"in {folder!r} (with its card): retry with `hf upload {repo_id} {folder} .` (huggingface_hub's "
                f"CLI), HfApi().upload_folder(repo_id={repo_id!r}, folder_path={folder!r}), or push_to_hub again "
                "once the Hub can be reached (and you are logged in: `hf auth login`)."
            ) from error
        shutil.rmtree(folder, ignore_errors=True)
        return uploaded

    return push_to_hub


@contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM until the block ends (POSIX main thread; elsewhere a no-op)."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _side_prefix(destination: str, kind: str) -> str:
    """Name prefix of the hidden folders a save of ``destination`` keeps beside it; the pid follows."""
    return f".{os.path.basename(destination)}.{kind}-{os.getpid()}-"


def _side_folders(destination: str, kind: str) -> list[tuple[str, int]]:
    """``(path, pid)`` of the hidden ``kind`` folders beside ``destination``."""
    parent, prefix = os.path.dirname(destination), f".{os.path.basename(destination)}.{kind}-"
    found = []
    for name in os.listdir(parent) if os.path.isdir(parent) else ():
        pid = name[len(prefix) :].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit():
            found.append((os.path.join(parent, name), int(pid)))
    return found


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _adapter_consistent(folder: str) -> bool:
    """Whether every graft adapter under ``folder`` has the weights its config's checksum names."""
    for root, _, names in os.walk(folder):
        if CONFIG_NAME in names:
            try:
                verify_weights_checksum(root)
            except ValueError:
                return False
    return True


def _configs_replaced(backup: str, destination: str) -> bool:
    """Whether every adapter config the interrupted save was replacing has been moved into place (they move last)."""
    for root, _, names in os.walk(backup):
        if CONFIG_NAME in names:
            rel = os.path.relpath(os.path.join(root, CONFIG_NAME), backup)
            current = os.path.join(destination, rel)
            if os.path.isfile(current) and filecmp.cmp(os.path.join(backup, rel), current, shallow=False):
                return False
    return True


def recover_interrupted_save(destination: str) -> None:
    """Finish or undo a save of ``destination`` that a killed process left half done, and drop its staging folders.

    A save keeps hard links to the files it replaces in a hidden ``previous`` folder until every new file is in place.
    If one is left over from a dead process: when every replaced config has been moved into place (configs move last)
    and each config's weights checksum matches, the save had finished; otherwise the previous files are moved back.
    Either way the folder holds one whole adapter again.
    """
    for staging, pid in _side_folders(destination, STAGING):
        if not _alive(pid):
            shutil.rmtree(staging, ignore_errors=True)
    for backup, pid in _side_folders(destination, PREVIOUS):
        if _alive(pid):
            continue
        if not (_configs_replaced(backup, destination) and _adapter_consistent(destination)):
            for root, _, names in os.walk(backup):
                for name in names:
                    source = os.path.join(root, name)
                    target = os.path.join(destination, os.path.relpath(source, backup))
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    os.replace(source, target)
        shutil.rmtree(backup, ignore_errors=True)


def _move_into_place(staging: str, destination: str) -> None:
    """Move the staged files into ``destination`` (configs last), keeping links to the files they replace until all
    are in place, so that :func:`recover_interrupted_save` can undo a move a kill interrupted; a move that fails with
    an exception is undone here."""
    files = [
        os.path.relpath(os.path.join(root, name), staging) for root, _, names in os.walk(staging) for name in names
    ]
    files.sort(key=lambda rel: (os.path.basename(rel) == CONFIG_NAME, rel))  # configs last
    replaced = [rel for rel in files if os.path.isfile(os.path.join(destination, rel))]
    backup = None
    if replaced:
        backup = tempfile.mkdtemp(prefix=_side_prefix(destination, PREVIOUS), dir=os.path.dirname(destination))
        for rel in replaced:
            os.makedirs(os.path.dirname(os.path.join(backup, rel)), exist_ok=True)
            _link_or_copy(os.path.join(destination, rel), os.path.join(backup, rel))
    for rel in files:
        os.makedirs(os.path.dirname(os.path.join(destination, rel)), exist_ok=True)
    moved: list[str] = []
    with _signals_deferred():
        try:
            for rel in files:
                os.replace(os.path.join(staging, rel), os.path.join(destination, rel))
                moved.append(rel)
        except BaseException:  # a move failed (a full disk, permissions): put the previous files back
            for rel in reversed(moved):
                if rel in replaced:
                    os.replace(os.path.join(backup, rel), os.path.join(destination, rel))
                else:
                    os.remove(os.path.join(destination, rel))
            if backup is not None:  # kept if undoing failed too: the next save or load recovers from the links
                shutil.rmtree(backup, ignore_errors=True)
            raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)
