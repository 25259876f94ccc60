"""The checksum of a saved graft's weights file, recorded in its ``adapter_config.json`` and verified on load."""

from __future__ import annotations

import hashlib
import json
import os

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
CHECKSUM_FIELD = "weights_checksum"


def file_checksum(path: str | os.PathLike) -> str:
    """``"sha256:<hex>"`` of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def record_weights_checksum(folder: str | os.PathLike) -> None:
    """Write the checksum of ``folder``'s weights file into its config, if both exist and it is a graft adapter."""
    config_path, weights = os.path.join(folder, CONFIG_NAME), os.path.join(folder, WEIGHTS_NAME)
    if not (os.path.isfile(config_path) and os.path.isfile(weights)):
        return
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    if str(config.get("peft_type", "")).lower() != "graft":
        return
    config[CHECKSUM_FIELD] = file_checksum(weights)
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)


def verify_weights_checksum(folder: str | os.PathLike) -> None:
    """Refuse a saved graft whose weights file differs from the checksum its config records (a corrupt or altered
    file) with a ``ValueError``; a folder without a readable config, or a config without a checksum (older saves), is
    not checked."""
    try:
        with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return  # not a readable adapter folder: the loader reports it
    expected = config.get(CHECKSUM_FIELD) if isinstance(config, dict) else None
    weights = os.path.join(folder, WEIGHTS_NAME)
    if not expected or not os.path.isfile(weights):
        return
    if file_checksum(weights) != expected:
        raise ValueError(
            f"{weights!r} does not match the checksum recorded in its {CONFIG_NAME}: the file is truncated or "
            "corrupt, or was altered after saving. Save or download the adapter again."
        )
