"""theta_ft read from safetensors files on disk, one tensor at a time, one shard open at a time.

A fine-tuned checkpoint is never loaded whole: :class:`StreamedCheckpoint` is a read-only mapping from parameter
names to tensors whose lookups open the shard holding the tensor (closing the one open before, whose memory-mapped
pages the system then drops) and copy that one tensor out, or some rows of it (:meth:`StreamedCheckpoint.rows`).
Read in shard order, each shard is opened once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from .._files import check_file, read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def safetensors_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, str]] | None:
    """The safetensors files of a local checkpoint and its weight map (tensor name -> file name), or ``None`` if
    ``path`` is neither a ``.safetensors`` file nor a folder holding ``model.safetensors`` or a sharded index.

    Raises a ``ValueError`` naming the shard when the index lists a file that is missing or is not valid JSON, and
    naming the path when the file, the index or a shard is not a regular file (a folder, a device, a FIFO).
    """
    path = Path(path)
    is_file = not path.is_dir() and check_file(path, "fine-tuned checkpoint", missing_ok=True)  # a FIFO: refused
    if is_file and path.suffix == ".safetensors":
        return [path], {}
    index = path / INDEX_FILE
    if path.is_dir() and check_file(index, "safetensors index", missing_ok=True):
        try:
            weight_map = read_json(index, "safetensors index")["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            message = f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {error}"
            raise ValueError(message) from error
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names.")
        outside = sorted({shard for shard in weight_map.values() if Path(shard).name != shard or shard in (".", "..")})
        if outside:
            raise ValueError(
                f"{index}: 'weight_map' names shard {outside[0]!r}, which is not a file of the checkpoint's folder "
                "(shards are plain file names beside the index). The index was altered: save the fine-tuned model "
                "again."
            )
        files = sorted({path / shard for shard in weight_map.values()})
        missing = [f.name for f in files if not check_file(f, "checkpoint shard", missing_ok=True)]
        if missing:
            raise ValueError(
                f"The fine-tuned checkpoint {str(path)!r} lists shards that are missing: {missing}. Copy or download "
                "every shard named in model.safetensors.index.json."
            )
        return files, weight_map
    if path.is_dir() and check_file(path / SINGLE_FILE, "safetensors file", missing_ok=True):
        return [path / SINGLE_FILE], {}
    return None


class StreamedCheckpoint(Mapping[str, torch.Tensor]):
    """A read-only mapping of a safetensors checkpoint's tensors, read from disk on each lookup.

    ``files``: the shards; ``weight_map``: tensor name -> shard file name (an index's), or empty to read the keys of
    each file. ``rename``: model name -> checkpoint name, for checkpoints saved with or without the model's
    ``base_model_prefix``. Keys, shapes and dtypes come from the files' headers without reading any tensor.
    """

    def __init__(self, files: list[Path], weight_map: dict[str, str] | None = None) -> None:
        self._where: dict[str, Path] = {}
        self._headers: dict[str, tuple[tuple[int, ...], str]] = {}
        by_name = {f.name: f for f in files}
        for file in files:
            check_file(file, "checkpoint shard")  # a folder, device or FIFO: a ValueError naming it
            try:
                with safe_open(str(file), "pt") as handle:
                    for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                        header = handle.get_slice(key)
                        self._headers[key] = (tuple(header.get_shape()), header.get_dtype())
                        self._where.setdefault(key, file)
            except Exception as error:  # safetensors raises its own error types for corrupt files
                raise ValueError(f"Cannot read the safetensors file {str(file)!r}: {error}") from error
        for key, shard in (weight_map or {}).items():
            if key not in self._headers or self._where[key] != by_name[shard]:
                raise ValueError(
                    f"The checkpoint index maps {key!r} to {shard}, but that shard does not hold it: the index and "
                    "the shards come from different saves. Save the fine-tuned model again."
                )
        self.rename: dict[str, str] = {}
        self._open: tuple[Path, object] | None = None

    def _key(self, name: str) -> str:
        """The checkpoint's name of the model's tensor ``name``."""
        return self.rename.get(name, name)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(self._key(name))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """``self[name][start:stop]``, reading only those rows (entries, for a 1-D tensor) from the file."""
        return self._handle(name).get_slice(self._key(name))[start:stop]

    def _handle(self, name: str):
        """The open handle of the shard holding tensor ``name`` (closing the one open before)."""
        key = self._key(name)
        if key not in self._where:
            raise KeyError(name)
        file = self._where[key]
        if self._open is None or self._open[0] != file:
            self.close()
            handle = safe_open(check_file(file, "checkpoint shard"), "pt")
            self._open = (file, handle.__enter__())
        return self._open[1]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._key(name) in self._where

    def __iter__(self) -> Iterator[str]:
        inverse = {key: name for name, key in self.rename.items()}
        return (inverse.get(key, key) for key in self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from the file header."""
        return self._headers[self._key(name)][0]

    def is_floating_point(self, name: str) -> bool:
        """Whether tensor ``name`` is floating point, from the file header."""
        return self._headers[self._key(name)][1] in _DTYPES

    def close(self) -> None:
        """Close the open shard (lookups reopen one)."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None

    def align_prefix(self, model_names: set[str], prefix: str) -> None:
        """Look tensors up under the checkpoint's names when it was saved with or without the model's
        ``base_model_prefix`` (e.g. a ``LlamaModel`` checkpoint for a ``LlamaForCausalLM``), as transformers does."""
        keys = set(self._where)
        if not prefix or keys & model_names:
            return
        dotted = f"{prefix}."
        added = {f"{dotted}{k}": k for k in keys}
        removed = {k[len(dotted) :]: k for k in keys if k.startswith(dotted)}
        best = max((added, removed), key=lambda m: len(m.keys() & model_names))
        if best.keys() & model_names:
            self.rename = best
