"""The integrity record of a saved graft, in its ``adapter_config.json``: the checksum of its weights file, verified on
load, and the format version that says which fields a save records (:func:`check_integrity_fields`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping

import torch

from ._files import open_file, read_json

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
CHECKSUM_FIELD = "weights_checksum"
VERSION_FIELD = "format_version"
FORMAT_VERSION = 1
"""Saves of format 1 record ``weights_checksum``, and ``base_checksum`` and ``base_fingerprint`` for every module in
``grafted_modules``. 0 (set by hand) marks a save of an older peft_graft that lacks some of them, loaded knowingly."""
LEGACY_FORMAT = 0

logger = logging.getLogger(__name__)


def file_checksum(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of the file's bytes."""
    digest, read = hashlib.sha256(), 0
    with open_file(path, "adapter weights file") as (handle, size):  # a regular file: read to its size, no more
        while read < size:
            block = handle.read(min(1 << 20, size - read))
            if not block:
                break
            digest.update(block)
            read += len(block)
    return f"sha256:{digest.hexdigest()}"


def state_checksum(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """``"sha256:<hex>"`` of a state saved as one safetensors file: every tensor (name, dtype, shape, bytes) and the
    metadata but the checksum itself (its key ``"checksum"``)."""
    digest = hashlib.sha256()
    for key in sorted(metadata):
        if key != "checksum":
            digest.update(json.dumps([key, metadata[key]]).encode())
    for key in sorted(tensors):
        tensor = tensors[key]
        digest.update(json.dumps([key, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor_bytes(tensor))  # a buffer: hashed without a copy
    return f"sha256:{digest.hexdigest()}"


def tensor_bytes(tensor: torch.Tensor):
    """The raw bytes of ``tensor`` (any dtype), for hashing without a copy."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def record_weights_checksum(folder: str | os.PathLike) -> None:
    """Write the checksum of ``folder``'s weights file into its config, if both exist and it is a graft adapter."""
    config_path, weights = os.path.join(folder, CONFIG_NAME), os.path.join(folder, WEIGHTS_NAME)
    if not (os.path.isfile(config_path) and os.path.isfile(weights)):
        return
    config = read_json(config_path, "adapter config")
    if str(config.get("peft_type", "")).lower() != "graft":
        return
    config[CHECKSUM_FIELD] = file_checksum(weights)
    if not missing_integrity_fields(config):  # a legacy graft saved again without them stays marked as legacy
        config[VERSION_FIELD] = FORMAT_VERSION
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)


def verify_weights_checksum(folder: str | os.PathLike) -> None:
    """Refuse a saved graft whose weights file differs from the checksum its config records (a corrupt or altered
    file) with a ``ValueError``; a folder without a readable config, or a config without a checksum (older saves), is
    not checked."""
    try:
        config = read_json(os.path.join(folder, CONFIG_NAME), "adapter config")
    except (OSError, ValueError):
        return  # not a readable adapter folder: the loader reports it
    expected = config.get(CHECKSUM_FIELD) if isinstance(config, dict) else None
    weights = os.path.join(folder, WEIGHTS_NAME)
    if not expected or not os.path.lexists(weights):
        return
    if file_checksum(weights) != expected:  # a folder, device or FIFO there: a ValueError naming it (open_file)
        raise ValueError(
            f"{weights!r} does not match the checksum recorded in its {CONFIG_NAME}: the file is truncated or "
            "corrupt, or was altered after saving. Save or download the adapter again."
        )


def missing_integrity_fields(config: dict) -> list[str]:
    """The integrity fields a graft's config (as saved) lacks: ``weights_checksum``, and ``base_checksum`` and
    ``base_fingerprint`` of each grafted module (those two only while ``verify_base`` holds)."""
    missing = [] if config.get(CHECKSUM_FIELD) else [CHECKSUM_FIELD]
    if config.get("verify_base", True):
        for field in ("base_checksum", "base_fingerprint"):
            recorded = config.get(field)
            recorded = recorded if isinstance(recorded, dict) else {}
            lacking = sorted(set(config.get("grafted_modules") or {}) - set(recorded))
            if lacking:
                missing.append(f"{field} of {lacking[0]!r}" + (f" and {len(lacking) - 1} more" if lacking[1:] else ""))
    return missing


def check_format_version(path: str | os.PathLike, version: object) -> None:
    """Refuse a graft config's ``format_version`` outside the formats this version reads (``ValueError`` naming the
    file); absent (``None``) is read as the current format."""
    if version is None or (type(version) is int and LEGACY_FORMAT <= version <= FORMAT_VERSION):
        return
    raise ValueError(
        f"{os.fspath(path)!r} has format_version={version!r}, but this peft_graft reads formats {LEGACY_FORMAT} and "
        f"{FORMAT_VERSION} only ({FORMAT_VERSION}: saved by peft_graft; {LEGACY_FORMAT}: an older save without some "
        "integrity fields, loaded knowingly). A save of a newer peft_graft needs that version; otherwise the file was "
        "altered: save or download the adapter again."
    )


def check_integrity_fields(folder: str | os.PathLike, config: object | None = None) -> None:
    """Refuse a saved graft whose config lacks an integrity field (:func:`missing_integrity_fields`) with a
    ``ValueError`` naming the file: deleting one would switch its check off. A graft saved by an older peft_graft
    without them loads when its ``format_version`` is set to 0, in the file or in the config passed to the loader
    (``config``, a ``GraftConfig`` whose ``format_version`` and ``verify_base`` then count). A folder without a
    readable graft config is left to the loader."""
    path = os.path.join(folder, CONFIG_NAME)
    try:
        saved = read_json(path, "adapter config")
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict) or str(saved.get("peft_type", "")).lower() != "graft":
        return
    if config is not None:
        saved = {**saved, VERSION_FIELD: config.format_version, "verify_base": config.verify_base}
    check_format_version(path, saved.get(VERSION_FIELD))
    missing = missing_integrity_fields(saved)
    if missing and saved.get(VERSION_FIELD) == LEGACY_FORMAT:
        logger.warning(
            "%r has format_version 0 (a save of an older peft_graft) and lacks %s: its integrity could not be checked "
            "(a corrupt or altered file, or another base model, may go unnoticed).",
            path,
            ", ".join(missing),
        )
    elif missing:
        raise ValueError(
            f"{path!r} lacks {', '.join(missing)}: a graft saved by peft_graft records them, so the file was altered "
            "and its checks would be skipped. Save or download the adapter again. A graft saved by an older "
            "peft_graft without them loads knowingly: config = GraftConfig.from_pretrained(path); "
            "config.format_version = 0; PeftModel.from_pretrained(model, path, config=config)."
        )
