"""Serving grafts of tasks with different numbers of classes from one base model, in mixed batches.

A graft of a classification task stores its head whole (``modules_to_save``): ``C`` output rows for its ``C`` classes.
Mixed batches (``adapter_names=[...]``) need one logits tensor for the whole batch, so every task's head must have the
same number of rows. :func:`load_grafts` loads each graft onto a base whose head has the largest number of classes, its
head padded with rows that never win: zero weights and, where the head has a bias, a bias of :func:`pad_logit` (the
lowest finite value of the head's dtype). Task ``t``'s logits are the first ``C_t`` columns; with a bias, the padded
columns never win an argmax and get a softmax probability of exactly 0 (``exp`` underflows), so argmax and softmax over
the whole row are those of the task. A head without a bias (Llama's ``score``) gives padded logits of 0: slice
``logits[:, :C_t]``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from ._checksum import CONFIG_NAME, WEIGHTS_NAME, record_weights_checksum, verify_weights_checksum
from ._files import check_file

__all__ = ["load_grafts", "pad_logit"]

_PREFIX = "base_model.model."  # how a PeftModel's saved keys name a module of the base model


def pad_logit(dtype: torch.dtype) -> float:
    """The logit of a padded class: the lowest finite value of ``dtype`` (the head's), which never wins."""
    return torch.finfo(dtype).min


def load_grafts(model: torch.nn.Module, grafts: Mapping[str, str | os.PathLike], **kwargs) -> PeftModel:
    """Load every graft folder of ``grafts`` (adapter name -> folder) onto ``model``, heads padded to ``model``'s.

    Args:
        model: The pre-trained base whose head has the largest number of classes of the tasks, e.g.
            ``AutoModelForSequenceClassification.from_pretrained(base, num_labels=max_classes,
            ignore_mismatched_sizes=True)`` (its own head is never used when every graft stores its head whole).
        grafts: Adapter name -> folder saved by ``save_pretrained``; the first becomes the active adapter.
        **kwargs: Passed to ``PeftModel.from_pretrained`` and ``load_adapter`` (default: packed for inference).

    Returns:
        The ``PeftModel`` holding every graft under its name, ready for ``model(**batch, adapter_names=[...])``.

    A tensor the graft stores whole whose first dimension is smaller than the base's (a head with fewer classes) is
    padded (see the module docstring); the graft's own weights file is checked against its checksum first, and a padded
    copy is loaded from a temporary folder. A stored tensor with more rows than the base's, or another shape, is a
    ``ValueError`` naming the folder, the tensor and both shapes.
    """
    if not grafts:
        raise ValueError("load_grafts needs at least one graft: give {adapter name: folder}.")
    shapes = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in model.state_dict().items()}
    peft_model = None
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, folder) in enumerate(grafts.items()):
            source = _padded(Path(folder), shapes, Path(scratch, str(index)))
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, source, adapter_name=name, **kwargs)
            else:
                peft_model.load_adapter(source, adapter_name=name, **kwargs)
    return peft_model


def _padded(folder: Path, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], scratch: Path) -> str:
    """``folder`` itself when no stored tensor needs padding, else a padded copy of it in ``scratch``."""
    weights = folder / WEIGHTS_NAME
    if not check_file(weights, "adapter weights file", missing_ok=True):
        raise ValueError(f"{str(folder)!r} has no {WEIGHTS_NAME}: give a folder saved by save_pretrained.")
    verify_weights_checksum(folder)  # the copy gets its own checksum: check the original first
    tensors = load_file(str(weights))
    padded = False
    for key, tensor in tensors.items():
        target = shapes.get(key.removeprefix(_PREFIX))
        if target is None or tuple(tensor.shape) == target[0]:
            continue
        (rows, *rest), dtype = target
        if tensor.dim() != len(target[0]) or list(tensor.shape[1:]) != rest or tensor.shape[0] > rows:
            raise ValueError(
                f"{str(weights)!r}: {key} has shape {tuple(tensor.shape)}, the base model's "
                f"{key.removeprefix(_PREFIX)} {target[0]}: only a head with fewer output rows (classes) than the "
                "base's is padded. Build the base with the grafts' architecture and the largest number of classes of "
                "the tasks (num_labels)."
            )
        fill = pad_logit(dtype) if tensor.dim() == 1 else 0.0
        tensors[key] = torch.cat([tensor, tensor.new_full((rows - tensor.shape[0], *rest), fill)])
        padded = True
    if not padded:
        return str(folder)
    scratch.mkdir(parents=True)
    save_file(tensors, str(scratch / WEIGHTS_NAME), metadata={"format": "pt"})
    shutil.copy(folder / CONFIG_NAME, scratch / CONFIG_NAME)
    record_weights_checksum(scratch)
    return str(scratch)
