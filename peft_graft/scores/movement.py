"""Per-entry scores from two checkpoints: the movement ``theta_ft - theta_pre`` of every eligible tensor, checked.

The movement is the paper's score for ``gamma_base`` (top-k of ``|theta_ft - theta_pre|``) and the ``delta`` a graft
stores on its region.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from .._files import check_file, read_json
from ..parameter_layout import Layout, peft_free_name
from .checkpoint import StreamedCheckpoint, safetensors_files


def load_finetuned(source: object, base_model: nn.Module) -> Mapping[str, torch.Tensor]:
    """theta_ft as a mapping of tensors by parameter name: a model object's state dict, a state dict as given, or,
    for a path or Hub id of safetensors files (one file or sharded), a :class:`StreamedCheckpoint` that reads one
    tensor at a time from one open shard. Other checkpoints (e.g. ``pytorch_model.bin`` only) are loaded whole with
    ``from_pretrained``."""
    if isinstance(source, nn.Module):
        _check_model_type(getattr(getattr(source, "config", None), "model_type", None), base_model)
        return source.state_dict()
    if isinstance(source, (str, os.PathLike)):
        found = safetensors_files(_local_checkpoint(source))
        if found is not None:
            checkpoint = StreamedCheckpoint(*found)
            _check_model_type(_saved_model_type(found[0][0].parent), base_model)
            names = {peft_free_name(n) for n, _ in base_model.named_parameters(remove_duplicate=False)}
            checkpoint.align_prefix(names, getattr(base_model, "base_model_prefix", ""))
            return checkpoint
        model_cls = type(base_model)
        if not hasattr(model_cls, "from_pretrained"):
            raise TypeError(
                f"finetuned={source!r} is a path, but the base model {model_cls.__name__} has no from_pretrained: "
                "pass the fine-tuned model object or its state dict instead."
            )
        try:
            finetuned = model_cls.from_pretrained(os.fspath(source), dtype=torch.float32)
        except OSError as error:
            raise ValueError(f"Cannot load the fine-tuned model finetuned={source!r}: {error}") from error
        _check_model_type(finetuned.config.model_type, base_model)
        return finetuned.state_dict()
    if isinstance(source, Mapping):
        bad = next((key for key in source if not isinstance(key, str)), None)
        if bad is not None:
            raise TypeError(f"finetuned, a state dict, must have parameter names (str) as keys, got {bad!r}.")
        return source
    raise TypeError(
        f"finetuned must be a model, a path or Hub id, or a state dict; got {type(source).__name__}. Pass it as "
        "GraftConfig(finetuned=...)."
    )


def _local_checkpoint(source: str | os.PathLike) -> str | os.PathLike:
    """A local path as it is; a Hub id as the local snapshot of its safetensors files (downloaded if needed), or as it
    is when that fails (``from_pretrained`` then says why)."""
    if os.path.exists(source):
        return source
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.safetensors", "model.safetensors.index.json", "config.json"]
        return snapshot_download(os.fspath(source), allow_patterns=patterns)
    except Exception:  # not a Hub id, offline, gated: from_pretrained reports it
        return source


def _saved_model_type(folder: os.PathLike) -> str | None:
    config = os.path.join(folder, "config.json")
    if not check_file(config, "model config", missing_ok=True):
        return None
    try:
        return read_json(config, "model config").get("model_type")
    except (ValueError, AttributeError):
        return None


def _check_model_type(ft_type: str | None, base_model: nn.Module) -> None:
    base_type = getattr(getattr(base_model, "config", None), "model_type", None)
    if base_type and ft_type and base_type != ft_type:
        raise ValueError(
            f"finetuned is a {ft_type!r} model but the pre-trained model is {base_type!r}: a graft needs theta_ft "
            "fine-tuned from this very pre-trained model."
        )


def _as_patterns(patterns: list[str] | str | None) -> list[re.Pattern]:
    if patterns is None:
        return []
    return [re.compile(p) for p in ([patterns] if isinstance(patterns, str) else patterns)]


def saved_whole_module(module: str, modules_to_save: list[str] | None) -> str | None:
    """The module stored whole (``modules_to_save``) that is ``module`` or holds it, or ``None``. Resolved as peft
    resolves the entries (``peft.utils.other._set_trainable``): peft wraps every module whose name ends with an entry
    (``"pooler"`` wraps ``bert.pooler``), and everything inside a wrapped module is stored whole with it."""
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        ancestor = ".".join(parts[:end])
        if any(ancestor.endswith(entry) for entry in modules_to_save or ()):
            return ancestor
    return None


def is_saved_whole(name: str, modules_to_save: list[str] | None) -> bool:
    """Whether the tensor ``name`` belongs to a module stored whole (:func:`saved_whole_module`)."""
    return saved_whole_module(name.rpartition(".")[0], modules_to_save) is not None


def eligible_tensors(
    layout: Layout,
    include: list[str] | str | None = None,
    exclude: list[str] | str | None = None,
    modules_to_save: list[str] | None = None,
) -> list[str]:
    """Names of the floating-point tensors that pass the name filters and are not saved whole (before ``only_moved``).

    ``include``/``exclude``: regexes (``GraftConfig.include_parameters``/``exclude_parameters``) searched in every
    name of a tensor.
    """
    include, exclude = _as_patterns(include), _as_patterns(exclude)
    names = []
    for name, info in layout.tensors.items():
        if not info.parameter.is_floating_point():
            continue
        if any(is_saved_whole(alias, modules_to_save) for alias in info.aliases):
            continue
        if include and not any(p.search(a) for p in include for a in info.aliases):
            continue
        if exclude and any(p.search(a) for p in exclude for a in info.aliases):
            continue
        names.append(name)
    return names


def finetuned_tensor(state: Mapping[str, torch.Tensor], layout: Layout, name: str) -> torch.Tensor:
    """theta_ft of the tensor ``name``, found under any of its aliases, shape-checked."""
    return state[_finetuned_key(state, layout, name)]


def _finetuned_key(state: Mapping[str, torch.Tensor], layout: Layout, name: str) -> str:
    """The alias under which ``state`` holds theta_ft of tensor ``name``, after checking its shape (from the file
    header for a :class:`StreamedCheckpoint`, so nothing is read)."""
    info = layout.tensors[name]
    key = next((a for a in info.aliases if a in state), None)
    if key is None:
        raise ValueError(
            f"The fine-tuned model has no tensor {name!r} (aliases {list(info.aliases)}): is it fine-tuned from "
            "this pre-trained model?"
        )
    if isinstance(state, StreamedCheckpoint):
        shape, floating = state.shape(key), state.is_floating_point(key)
    else:
        value = state[key]
        if not torch.is_tensor(value):
            raise TypeError(f"theta_ft of {name!r} must be a tensor, got {type(value).__name__}.")
        if value.is_meta:
            raise ValueError(f"theta_ft of {name!r} is on the meta device: load the fine-tuned model's weights first.")
        shape, floating = tuple(value.shape), value.is_floating_point()
    if info.parameter.is_floating_point() and not floating:
        raise TypeError(
            f"theta_ft of {name!r} is not floating point (theta_pre is {info.parameter.dtype}): the fine-tuned model "
            "must hold the same kind of values as the pre-trained one."
        )
    if tuple(shape) != tuple(info.parameter.shape):
        raise ValueError(
            f"Tensor {name!r} has shape {tuple(shape)} in the fine-tuned model but "
            f"{tuple(info.parameter.shape)} in the pre-trained model."
        )
    return key


PIECE = 1 << 20  # entries of theta_ft read and differenced at once (4 MB of fp32): the movement's working memory


def finetuned_pieces(
    state: Mapping[str, torch.Tensor], layout: Layout, name: str, size: int | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(flat start, theta_pre piece, theta_ft piece)`` covering tensor ``name`` flattened, in order, in pieces of
    whole rows of about ``size`` entries (:data:`PIECE` by default; one row at least).

    From a :class:`StreamedCheckpoint` only those rows are read from the file, so no whole tensor of theta_ft is ever
    in memory; from tensors in memory the pieces are views. theta_ft pieces are moved to theta_pre's device.
    """
    key, size = _finetuned_key(state, layout, name), size or PIECE
    pre = layout.tensors[name].parameter.detach()
    flat_pre = pre.reshape(-1)
    if pre.dim() == 0 or not isinstance(state, StreamedCheckpoint):
        flat_ft = state[key].detach().reshape(-1)
        for start in range(0, flat_pre.numel(), size):
            yield start, flat_pre[start : start + size], flat_ft[start : start + size].to(pre.device)
        return
    row = flat_pre.numel() // pre.shape[0] if pre.shape[0] else 1
    rows = max(1, size // max(row, 1))
    for first in range(0, pre.shape[0], rows):
        piece = state.rows(key, first, first + rows).reshape(-1).to(pre.device)
        start = first * row
        yield start, flat_pre[start : start + piece.numel()], piece


def compute_movement(
    state: Mapping[str, torch.Tensor], layout: Layout, names: list[str], only_moved: bool
) -> Mapping[str, torch.Tensor]:
    """``theta_ft - theta_pre`` in fp32 for each tensor in ``names`` (see :func:`exact_movement`)."""
    return exact_movement(state, layout, names, only_moved)[0]


class Movement(Mapping[str, torch.Tensor]):
    """``theta_ft - theta_pre`` (fp32, :func:`exact_delta`) of each tensor in ``names``, computed when looked up.

    :meth:`pieces` computes a tensor's movement one piece of :data:`PIECE` entries at a time, and :meth:`gather` only
    given entries: the region strategies (:func:`peft_graft.regions.global_top_k`) read it so, and never hold a whole
    tensor of theta_ft or of its movement. A lookup computes a whole tensor (kept until the next lookup). Read in
    parameter order, a :class:`StreamedCheckpoint` opens each shard once per pass. Sizes come from theta_pre
    (:meth:`numel`) without computing anything.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], layout: Layout, names: list[str]) -> None:
        self._state, self._layout, self._names = state, layout, list(names)
        self._known = set(self._names)
        self._last: tuple[str, torch.Tensor] | None = None
        # Whether gather keeps its last result per tensor (sorted flat indices, movement there), to answer a later
        # gather of some of those entries: set while the values of a learned region's search space are read.
        self.keep_gathered = False
        self._gathered: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        if self._last is None or self._last[0] != name:
            self._last = None  # free the previous tensor before computing the next
            pre = self._layout.tensors[name].parameter
            delta = torch.empty(pre.shape, dtype=torch.float32, device=pre.device)
            for start, piece in self.pieces(name):
                delta.view(-1)[start : start + piece.numel()] = piece
            self._last = (name, delta)
        return self._last[1]

    def pieces(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """``(flat start, fp32 movement)`` covering tensor ``name`` flattened, one piece computed at a time."""
        if name not in self._known:
            raise KeyError(name)
        for start, pre, finetuned in finetuned_pieces(self._state, self._layout, name):
            yield start, exact_delta(pre, finetuned)[0]

    def gather(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """The fp32 movement of tensor ``name`` at the flat ``indices`` (any order), read piece by piece.

        :func:`exact_delta` is element-wise, so it runs on the wanted entries only: the values are those of
        :meth:`pieces` bit for bit, at the cost of reading theta_ft rather than of differencing all of it. With
        ``keep_gathered``, indices all among those of the tensor's previous gather are answered from it without
        reading theta_ft (a learned region's search space, then its ``gamma_base`` and values among it).
        """
        if name not in self._known:
            raise KeyError(name)
        indices = indices.to(torch.int64)
        known = self._gathered.get(name)
        if known is not None and known[0].numel():
            known_indices = known[0].to(indices.device)
            at = torch.searchsorted(known_indices, indices).clamp_max(known_indices.numel() - 1)
            if bool((known_indices[at] == indices).all()):
                return known[1].to(indices.device)[at]
        order = indices.argsort()
        wanted = indices[order]
        values = torch.empty(wanted.numel(), dtype=torch.float32, device=indices.device)  # in the order of wanted
        for start, pre, finetuned in finetuned_pieces(self._state, self._layout, name):
            low, high = torch.searchsorted(wanted, torch.tensor([start, start + pre.numel()], device=wanted.device))
            if high > low:
                local = (wanted[low:high] - start).to(pre.device)
                values[low:high] = exact_delta(pre[local], finetuned[local])[0].to(values.device)
        if self.keep_gathered:
            self._gathered[name] = (wanted, values)
        return torch.empty_like(values).index_copy_(0, order, values)

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def numel(self, name: str) -> int:
        """Number of entries of tensor ``name``."""
        return self._layout.tensors[name].parameter.numel()


def exact_movement(
    state: Mapping[str, torch.Tensor], layout: Layout, names: list[str], only_moved: bool
) -> tuple[Movement, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The movement ``theta_ft - theta_pre`` (fp32) of each tensor in ``names``, and what no fp32 delta reproduces.

    One pass over the tensors, piece by piece (:func:`finetuned_pieces`), checks theta_ft (finite), finds which
    tensors moved and the entries no fp32 delta reproduces; the movement itself is a :class:`Movement`, computed again
    when read. Each delta is that of :func:`exact_delta`: ``(theta_pre.float() + delta).to(dtype)`` is ``theta_ft``
    bit for bit wherever an fp32 delta can give it. The second dict holds, per tensor, the sorted flat indices where
    none can (typically entries that fine-tuning shrank towards 0, whose delta is far larger than their value) and
    theta_ft there as fp32. Unmoved tensors are dropped if ``only_moved``.
    """
    kept, unreachable = [], {}
    for name in names:
        moved, bad, missed_at, missed_ft = False, 0, [], []
        for start, pre, finetuned in finetuned_pieces(state, layout, name):
            delta, missed = exact_delta(pre, finetuned)
            low, high = (float(v) for v in torch.aminmax(delta))  # NaN if any entry is NaN: one pass for both checks
            if not (math.isfinite(low) and math.isfinite(high)):
                bad += int((~torch.isfinite(delta)).sum())
            any_missed = bool(missed.any())
            moved = moved or low != 0 or high != 0 or any_missed
            if any_missed:
                flat = missed.nonzero().reshape(-1)
                missed_at.append(flat + start)
                missed_ft.append(finetuned[flat].to(pre.dtype).float())
        if bad:
            raise ValueError(f"theta_ft - theta_pre has {bad} NaN or inf entries in tensor {name!r}.")
        if only_moved and not moved:
            continue
        kept.append(name)
        if missed_at:
            unreachable[name] = (torch.cat(missed_at), torch.cat(missed_ft))
    return Movement(state, layout, kept), unreachable


_CHUNK = 1 << 20  # entries per piece of exact_delta: its temporaries stay a few MB whatever the tensor's size


def exact_delta(pre: torch.Tensor, finetuned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``d`` with ``(pre.float() + d).to(pre.dtype) == finetuned.to(pre.dtype)`` bit for bit where one exists,
    and the boolean mask of the entries where none does.

    ``finetuned - pre`` rounded to fp32 almost always works; a miss of the sum's rounding is repaired by stepping ``d``
    an ulp towards the target. No fp32 ``d`` exists where ``|d|`` is so much larger than the target that fp32 steps of
    ``d`` are coarser than the target's own: e.g. a weight that fine-tuning shrank to a thousandth of its value.
    Computed in pieces of a few million entries, so the only tensor-sized memory is the result.
    """
    delta = torch.empty(pre.shape, dtype=torch.float32, device=pre.device)
    wrong = torch.empty(pre.shape, dtype=torch.bool, device=pre.device)
    flat_pre, flat_ft = pre.detach().reshape(-1), finetuned.detach().reshape(-1)
    flat_delta, flat_wrong = delta.view(-1), wrong.view(-1)
    for start in range(0, flat_pre.numel(), _CHUNK):
        piece = slice(start, start + _CHUNK)
        flat_delta[piece], flat_wrong[piece] = _exact_delta(flat_pre[piece], flat_ft[piece])
    return delta, wrong


def _exact_delta(pre: torch.Tensor, finetuned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    target = finetuned.to(pre.dtype)
    base = pre.float()
    rounded = delta = finetuned.float() - base
    applied = (base + delta).to(pre.dtype)
    if torch.equal(applied, target):  # the common case, and a cheaper test than the mask below (same NaN semantics)
        return delta, torch.zeros(delta.shape, dtype=torch.bool, device=delta.device)
    wrong = applied != target
    for _ in range(4):
        if not wrong.any():
            break
        direction = torch.where(applied < target, torch.inf, -torch.inf)
        delta = torch.where(wrong, torch.nextafter(delta, direction), delta)
        applied = (base + delta).to(pre.dtype)
        wrong = applied != target
    if wrong.any():  # keep the plain rounded delta there: the closest an additive graft gets
        delta = torch.where(wrong, rounded, delta)
    return delta, wrong
