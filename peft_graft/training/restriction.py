"""Training restricted to a region: change only entries inside ``allowed``, never entries inside ``frozen``.

The mechanism behind graft re-training, forget-free continual learning and multi-task "purify" steps (paper sections
3 and 5). One :class:`TrainingRestriction` does the work; :func:`restrict_training` starts it for a custom loop and
:class:`RestrictTrainingCallback` for any ``Trainer``.

Entries outside the allowed set stay bit-identical whatever the optimizer does, because masking gradients alone is not
enough (AdamW's decoupled weight decay and earlier momentum move entries with a zero gradient):

- A hook zeroes the disallowed entries of ``param.grad``, in place, each time a gradient is accumulated into it, so
  gradient clipping and gradient accumulation only see allowed gradients (a tied tensor is one parameter: one hook).
- A tensor with no allowed entry has its gradient set to ``None`` just before the optimizer step: every
  ``torch.optim`` optimizer skips it entirely (no update, no decay, no state change).
- A tensor with some allowed entries keeps the flat indices of its smaller side (the disallowed entries, e.g. earlier
  tasks' regions, or the allowed ones, e.g. a region to re-train). Just before the step, the disallowed values are
  copied; right after it they are written back.
- When the allowed side is the smaller, copying the disallowed side would mean copying nearly the whole tensor. With
  ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (not ``maximize``) it is not needed: an entry whose gradient and optimizer
  state have always been zero gets an update of exactly zero, so only weight decay could move it. For the step, such
  tensors move to a parameter group of their own without weight decay, and the decay is applied to their allowed
  entries by hand, as the optimizer would, when its step begins (a step pre-hook: after a ``torch.amp.GradScaler``
  unscaled the gradients, and not at all on a step the scaler skips for inf/NaN gradients). Any other optimizer, or
  optimizer state that is not zero outside the allowed entries (the optimizer stepped before the restriction began),
  takes the copy above.

Under FSDP2 (``fully_shard``) each process restricts the shard of every parameter it holds, with indices local to it;
FSDP2 runs the gradient hooks on each reduced shard, before clipping and the step.

Under DeepSpeed ZeRO-3 the optimizer step happens inside DeepSpeed's engine (``engine.step()``, which accelerate calls
from ``accelerator.backward`` at the end of each accumulation), on flat fp32 copies of each process's partition of the
parameters. The restriction wraps that step (``param._z3_optimizer.step``, so it must be created once the engine
exists: :class:`RestrictTrainingCallback` does it when training begins). Each process works on its partitions, with
indices local to them: before the step it zeroes the disallowed entries of the reduced gradient partitions (so that
the gradient clipping DeepSpeed does inside its step sees only allowed gradients) and copies the disallowed fp32
values; right after the inner ``torch.optim`` optimizer stepped (a step post-hook), it writes them back, before
DeepSpeed copies the fp32 values into the model's partitions (and gathers persistent parameters). Every restricted
tensor takes this copying path: its fp32 partition is copied around each step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from ..parameter_layout import PEFT_PREFIX, peft_free_name
from ..regions import Region
from ..sharding import (
    deepspeed_refusal,
    full_numel,
    is_partitioned,
    is_sharded,
    local_flat,
    partition_span,
    zero_stage,
)

ACTION = "Restricted training (TrainingRestriction, RestrictTrainingCallback)"
ZERO3_ONLY = (
    "peft_graft restricts training under DeepSpeed only at ZeRO-3 (zero_optimization.stage 3), where it restricts the "
    "step DeepSpeed takes on each process's partitions; ZeRO-1/2 step flat fp32 copies of whole parameters whose "
    "entries the restriction does not reach. Use ZeRO-3, FSDP2 (fully_shard: Trainer fsdp=True with "
    "fsdp_config={'version': 2}) or DDP; see docs/fsdp.md."
)


@dataclass
class _Restricted:
    """One parameter tensor and what of it may not change: all of it (``indices is None``); or, for a partly allowed
    tensor, the flat ``indices`` of its disallowed entries (``inside_allowed=False``) or of its allowed ones
    (``True``), whichever side is smaller."""

    param: nn.Parameter
    indices: torch.Tensor | None
    inside_allowed: bool = False
    saved: torch.Tensor | None = None
    zero_state: dict[int, bool] = field(default_factory=dict)  # optimizer id -> state zero outside the allowed entries


class _Zero3Step:
    """The restriction of DeepSpeed ZeRO-3's own optimizer step (see the module's docstring): ``restricted`` hold
    indices local to this process's partitions."""

    def __init__(self, optimizer, restricted: list[_Restricted]) -> None:
        optimizer._graft_restricted = True
        self.optimizer = optimizer
        self.restricted = restricted
        self.spans = [partition_span(e.param)[1] for e in restricted]  # real (not padding) entries held here
        original = self.optimizer.step

        def step(*args, **kwargs):
            self._mask_and_copy()
            try:
                return original(*args, **kwargs)
            finally:
                for entry in self.restricted:
                    entry.saved = None

        self._step = step
        self.optimizer.step = step  # the engine calls self.optimizer.step()
        self._hook = self.optimizer.optimizer.register_step_post_hook(lambda *_: self._write_back())

    def _mask_and_copy(self) -> None:
        """Before DeepSpeed's step: zero the disallowed gradient entries, copy the disallowed fp32 values."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad, safe_set_local_grad

        with torch.no_grad():
            for entry, count in zip(self.restricted, self.spans, strict=True):
                grad = safe_get_local_grad(entry.param).clone()
                _zero_disallowed(grad[:count], entry)
                safe_set_local_grad(entry.param, grad)
                master = safe_get_local_fp32_param(entry.param)[:count]
                whole = entry.indices is None or entry.inside_allowed
                entry.saved = (master if whole else master[entry.indices]).clone()

    def _write_back(self) -> None:
        """After the inner optimizer stepped (once per DeepSpeed sub-group: idempotent), before DeepSpeed copies the
        fp32 values into the partitions: write the copied values back."""
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        with torch.no_grad():
            for entry, count in zip(self.restricted, self.spans, strict=True):
                if entry.saved is None:
                    continue
                master = safe_get_local_fp32_param(entry.param).clone()
                real = master[:count]
                if entry.indices is None:
                    real.copy_(entry.saved)
                elif entry.inside_allowed:
                    stepped = real[entry.indices]
                    real.copy_(entry.saved)
                    real[entry.indices] = stepped
                else:
                    real[entry.indices] = entry.saved
                safe_set_local_fp32_param(entry.param, master)

    def remove(self) -> None:
        del self.optimizer.step  # the class's step again
        self._hook.remove()
        self.optimizer._graft_restricted = False


def _zero3_optimizer(model: nn.Module):
    """The ZeRO-3 optimizer of the DeepSpeed engine training ``model`` (a ``ValueError`` without one, or with an
    offloaded optimizer)."""
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    optimizers = {id(p._z3_optimizer): p._z3_optimizer for _, p in trainable if getattr(p, "_z3_optimizer", None)}
    if len(optimizers) != 1:
        raise ValueError(
            f"{ACTION} under DeepSpeed ZeRO-3 restricts the step of the DeepSpeed engine training the model, which "
            "does not exist yet (or several do): create it once deepspeed.initialize (or the Trainer) has built the "
            "engine, as RestrictTrainingCallback does when training begins."
        )
    outside = [name for name, param in trainable if not getattr(param, "_z3_optimizer", None)]
    if outside:
        raise ValueError(
            f"{ACTION} under DeepSpeed ZeRO-3: the parameters {outside[:3]} require gradients but are not in the "
            "DeepSpeed engine's optimizer: give the engine all trainable parameters, or set requires_grad=False on "
            "these before deepspeed.initialize."
        )
    optimizer = next(iter(optimizers.values()))
    if getattr(optimizer, "_graft_restricted", False):
        raise ValueError(
            f"{ACTION}: another restriction already restricts this DeepSpeed engine's step; remove() it first (or "
            "pass the union of the regions to one restriction)."
        )
    if optimizer.offload_optimizer:
        raise deepspeed_refusal(
            ACTION,
            "DeepSpeed ZeRO-3 with offload_optimizer",
            "the offloaded optimizer keeps its fp32 partitions and gradients apart from the ones restricted here. "
            "Remove offload_optimizer from the DeepSpeed config, or use FSDP2 or DDP; see docs/fsdp.md.",
        )
    _check_fp32_copies(model, getattr(optimizer, "dp_process_group", None))
    return optimizer


def _check_fp32_copies(model: nn.Module, group) -> None:
    """Refuse an engine whose fp32 copy of a trainable partition is not the partition: the partition was written since
    the engine was built, and DeepSpeed's next step would copy the stale fp32 values over the write (and the
    restriction would keep them). Decided together by the processes of ``group`` (a collective): each holds other
    partitions, and all must refuse or none."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import safe_get_local_fp32_param

    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    first = len(trainable)  # the first parameter written since, by number (none: len)
    for number, (_, param) in enumerate(trainable):
        master = safe_get_local_fp32_param(param)[: partition_span(param)[1]]
        part = param.ds_tensor.detach().view(-1)[: master.numel()].to(master.device)
        held = master.to(part.dtype)
        if not bool(((held == part) | (held.isnan() & part.isnan())).all()):
            first = number
            break
    if dist.is_initialized():
        found = torch.tensor([first], device=get_accelerator().current_device_name())
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=group)
        first = int(found.item())
    if first < len(trainable):
        raise ValueError(
            f"{ACTION} under DeepSpeed ZeRO-3: parameter {trainable[first][0]!r} was written since DeepSpeed built its "
            "engine (as ContinualGrafter's start_task, abort_task or from_pretrained write), and the engine's fp32 "
            "copy, which its next step copies into the model, does not hold the write. Make such writes before the "
            "engine is built: between Trainer runs, or before deepspeed.initialize in a custom loop."
        )


class TrainingRestriction:
    """Restrict which parameter entries of ``model`` training may change.

    Args:
        model: The model being trained (a plain model, or a peft model: names are matched without peft's prefixes).
        allowed: Only entries inside this region may change (``None``: every entry). Tensors the region does not
            name are frozen whole, so a new head stored whole must be in it to train (``Region`` of all its entries).
        frozen: Entries inside this region never change (``None``: none), e.g. the union of earlier tasks' regions.
            Where ``allowed`` and ``frozen`` overlap, ``frozen`` wins: those entries never change.

    Use :meth:`step` around ``optimizer.step()`` in a custom loop, or :class:`RestrictTrainingCallback` with a
    ``Trainer``; :meth:`remove` (or leaving the ``with`` block) detaches the gradient hooks. Under DeepSpeed ZeRO-3,
    create it after ``deepspeed.initialize`` and step the engine as usual (``engine.step()``): the restriction acts
    inside DeepSpeed's step, and :meth:`remove` gives DeepSpeed its own step back.
    """

    def __init__(self, model: nn.Module, allowed: Region | None = None, frozen: Region | None = None) -> None:
        stage = zero_stage(model)
        if stage is not None and stage != 3:
            raise deepspeed_refusal(ACTION, f"DeepSpeed ZeRO-{stage}", ZERO3_ONLY)
        zero3_optimizer = _zero3_optimizer(model) if stage == 3 else None
        for name, region in (("allowed", allowed), ("frozen", frozen)):
            if region is not None and not isinstance(region, Mapping):
                raise TypeError(f"{name} must be a Region (parameter name -> flat indices), got {type(region)}.")
        names_of: dict[int, set[str]] = {}  # a parameter's plain names (tied tensors have several)
        params: dict[int, nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if "graft_learning" in name and param.requires_grad:
                raise ValueError(
                    f"The model is learning a graft region ({name!r} trains): MaskTrainer trains the scores S, not "
                    "model parameters, so a restriction would change nothing. Restrict the fine-tuning runs instead, "
                    "or choose the region's candidates with GraftConfig(include_parameters=..., region=...)."
                )
            if "graft_" not in name:  # a head stored whole: its trained copy and the original share the plain name
                names_of.setdefault(id(param), set()).add(peft_free_name(name.removeprefix(PEFT_PREFIX)))
                params[id(param)] = param
        if allowed is not None and not any(torch.as_tensor(idx).numel() for idx in allowed.values()):
            raise ValueError(
                "allowed is an empty region: training could change nothing. Pass the entries to train, or "
                "allowed=None to train every entry."
            )
        known = set().union(*names_of.values())
        for name, region in (("allowed", allowed), ("frozen", frozen)):
            unknown = sorted(set(region or {}) - known)
            if unknown:
                raise ValueError(
                    f"{name} names tensors the model does not have: {unknown[:5]}. Regions name parameters as the "
                    "plain (unwrapped) model does, e.g. graft.get_region()."
                )
        self.restricted: list[_Restricted] = []
        self._hooks = []
        self._regrouped: torch.optim.Optimizer | None = None  # set by _decay_by_hand until after_step undoes it
        self._groups_before: list[tuple[dict, list]] = []
        self._grads_before: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._decays: list[tuple[nn.Parameter, torch.Tensor, dict, bool]] = []  # (param, indices, group, decoupled)
        self._decay_hook = None
        for key, param in params.items():
            if not param.requires_grad:
                continue
            mask = self._disallowed(param, sorted(names_of[key]), allowed, frozen)
            if mask is not None:  # under FSDP2 or ZeRO-3, this process's shard or partition: its indices are local
                start, count = partition_span(param) if is_partitioned(param) else _shard_span(param)
                mask = mask[start : start + count]
            if mask is None or not mask.any():
                continue  # free: nothing to restrict
            num_disallowed = int(mask.sum())
            if num_disallowed == mask.numel():
                entry = _Restricted(param, None)
            elif num_disallowed <= mask.numel() // 2:
                entry = _Restricted(param, mask.nonzero().reshape(-1))
            else:
                entry = _Restricted(param, (~mask).nonzero().reshape(-1), inside_allowed=True)
            self.restricted.append(entry)
            if not is_partitioned(param):  # ZeRO-3 masks the reduced partitions in its step instead
                self._hooks.append(param.register_post_accumulate_grad_hook(_zeroing_hook(entry)))
        self._zero3 = _Zero3Step(zero3_optimizer, self.restricted) if stage == 3 else None

    @staticmethod
    def _disallowed(param, names, allowed, frozen) -> torch.Tensor | None:
        """Flat boolean mask of the entries of ``param`` that may not change, or ``None`` if all may."""
        numel = full_numel(param)
        disallowed = None
        if allowed is not None:
            disallowed = torch.ones(numel, dtype=torch.bool, device=param.device)
            for name in names:
                if name in allowed:
                    disallowed[_checked(allowed[name], numel, name, "allowed").to(param.device)] = False
        if frozen is not None:
            for name in (n for n in names if n in frozen):
                if disallowed is None:
                    disallowed = torch.zeros(numel, dtype=torch.bool, device=param.device)
                disallowed[_checked(frozen[name], numel, name, "frozen").to(param.device)] = True
        return disallowed

    @property
    def extra_bytes(self) -> int:
        """Bytes held between steps: the flat indices of the partly allowed tensors."""
        return sum(e.indices.numel() * e.indices.element_size() for e in self.restricted if e.indices is not None)

    def before_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Just before ``optimizer.step()``: drop the gradients of whole frozen tensors, copy partly frozen values (or,
        given a ``torch.optim`` SGD/Adam/AdamW ``optimizer``, take sparse allowed entries out of weight decay)."""
        if self._zero3 is not None:
            return  # restricted inside DeepSpeed's own step (which has run when a Trainer calls this)
        # Under accelerate's loss scaler (fp16) the gradients may still be scaled here, and a step may be skipped: the
        # hand-made weight decay of the sparse path would be wrong, so every tensor takes the copying path then.
        scaled = getattr(optimizer, "scaler", None) is not None
        optimizer = _unwrapped(optimizer)
        sparse = [e for e in self.restricted if e.inside_allowed and e.param.grad is not None and not scaled]
        sparse = [e for e in sparse if _zero_update_outside(e, optimizer)]
        if sparse:
            self._decay_by_hand(optimizer, sparse)
        skipped = {id(e) for e in sparse}
        for entry in self.restricted:
            flat = local_flat(entry.param)[0]
            if entry.indices is None:
                entry.param.grad = None
            elif id(entry) in skipped:
                continue
            elif entry.inside_allowed:
                entry.saved = flat.clone()
            else:
                entry.saved = flat[entry.indices].clone()

    def _decay_by_hand(self, optimizer: torch.optim.Optimizer, sparse: list[_Restricted]) -> None:
        """Move the ``sparse`` tensors to groups without weight decay for this step, and decay their allowed entries as
        the optimizer would (decoupled: ``p *= 1 - lr * wd``; coupled: ``grad += wd * p``) when its step begins."""
        by_param = {id(e.param): e for e in sparse}
        self._groups_before = [(group, group["params"]) for group in optimizer.param_groups]
        self._grads_before, self._decays = [], []
        extra = []
        for group in optimizer.param_groups:
            mine = [p for p in group["params"] if id(p) in by_param]
            if not mine or not group.get("weight_decay"):
                continue
            decoupled = isinstance(optimizer, torch.optim.Adam) and group.get("decoupled_weight_decay", False)
            for param in mine:
                self._decays.append((param, by_param[id(param)].indices.to(param.device), group, decoupled))
            group["params"] = [p for p in group["params"] if id(p) not in by_param]
            extra.append({**group, "params": mine, "weight_decay": 0.0})
        optimizer.param_groups.extend(extra)
        self._regrouped = optimizer
        if self._decays:
            self._decay_hook = optimizer.register_step_pre_hook(self._decay)

    def _decay(self, *_) -> None:
        """The step pre-hook of :meth:`_decay_by_hand`: runs only when the optimizer steps, on unscaled gradients."""
        with torch.no_grad():
            for param, idx, group, decoupled in self._decays:
                decay, lr = group["weight_decay"], group["lr"]
                flat = local_flat(param)[0]  # under FSDP2, this process's shard (idx is local to it)
                if decoupled:
                    flat[idx] = flat[idx].mul_(1 - lr * decay)
                else:
                    grad = local_flat(param.grad)[0]
                    self._grads_before.append((grad, idx, grad[idx].clone()))
                    grad[idx] = grad[idx].add_(flat[idx], alpha=decay)
        self._decays = []

    def after_step(self) -> None:
        """Right after ``optimizer.step()``: write the copied values back, bit for bit."""
        if self._regrouped is not None:  # undo _decay_by_hand's regrouping and gradient changes
            self._regrouped.param_groups[:] = [group for group, _ in self._groups_before]
            for group, params in self._groups_before:
                group["params"] = params
            for grad, idx, values in self._grads_before:
                grad[idx] = values
            if self._decay_hook is not None:
                self._decay_hook.remove()
            self._regrouped, self._groups_before, self._grads_before, self._decays = None, [], [], []
            self._decay_hook = None
        with torch.no_grad():
            for entry in self.restricted:
                if entry.saved is None:
                    continue
                flat = local_flat(entry.param)[0]
                if entry.inside_allowed:  # keep the stepped allowed entries, restore everything else
                    stepped = flat[entry.indices]
                    flat.copy_(entry.saved)
                    flat[entry.indices] = stepped
                else:
                    flat[entry.indices] = entry.saved
                entry.saved = None

    def step(self, optimizer: torch.optim.Optimizer, closure=None, scaler: torch.amp.GradScaler | None = None):
        """``optimizer.step(closure)`` under the restriction (for a custom loop); returns what the step returns.

        ``closure``: as ``torch.optim``'s (``LBFGS`` needs one): it recomputes the loss and its gradients, which the
        restriction masks as it does any gradient. ``scaler``: the ``torch.amp.GradScaler`` of a mixed precision loop,
        whose ``scaler.step(optimizer)`` is taken instead (a step it skips for inf/NaN gradients changes nothing; call
        ``scaler.update()`` after, as usual). Calling :meth:`before_step`, ``scaler.step(optimizer)`` and
        :meth:`after_step` does the same."""
        self.before_step(optimizer)
        try:
            if closure is not None:
                closure = self._masked_closure(closure)
            if scaler is not None:
                return scaler.step(optimizer) if closure is None else scaler.step(optimizer, closure)
            return optimizer.step() if closure is None else optimizer.step(closure)
        finally:
            self.after_step()

    def _masked_closure(self, closure):
        """``closure``, after which the tensors frozen whole have no gradient again (the optimizer skips them)."""

        def masked():
            loss = closure()
            for entry in self.restricted:
                if entry.indices is None:
                    entry.param.grad = None
            return loss

        return masked

    def remove(self) -> None:
        """Detach the gradient hooks; the model trains unrestricted again. A step left half done (``optimizer.step()``
        raised after :meth:`before_step`) is closed first, so the disallowed entries keep their values."""
        if self._regrouped is not None or any(entry.saved is not None for entry in self.restricted):
            self.after_step()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._zero3 is not None:
            self._zero3.remove()
            self._zero3 = None

    def __enter__(self) -> TrainingRestriction:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _checked(indices: torch.Tensor, numel: int, name: str, field: str) -> torch.Tensor:
    indices = torch.as_tensor(indices).to(torch.int64)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
        raise ValueError(f"{field} region: indices of {name!r} fall outside [0, {numel}).")
    return indices


def _unwrapped(optimizer):
    """The ``torch.optim`` optimizer inside accelerate's (or another) wrapper."""
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _zero_update_outside(entry: _Restricted, optimizer) -> bool:
    """Whether ``optimizer`` leaves the disallowed entries of ``entry`` exactly as they are, weight decay aside: an
    SGD/Adam/AdamW step (not ``maximize``) whose state is zero there (checked once per optimizer)."""
    if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        return False
    if any(group.get("maximize") or group.get("eps", 1.0) == 0 for group in optimizer.param_groups):
        return False  # (Adam with eps=0 divides 0 by 0 where the gradient and state are zero)
    key = id(optimizer)
    if key not in entry.zero_state:
        state, shape = optimizer.state.get(entry.param, {}), entry.param.shape
        allowed = entry.indices.to(entry.param.device)
        local = [local_flat(v)[0] for v in state.values() if isinstance(v, torch.Tensor) and v.shape == shape]
        entry.zero_state[key] = all(int(v.count_nonzero()) == int(v[allowed].count_nonzero()) for v in local)
    return entry.zero_state[key]


def _shard_span(param: nn.Parameter) -> tuple[int, int]:
    """``(flat index of the first entry, number of entries)`` this process holds of ``param`` (all of it unless FSDP2
    shards it)."""
    local, start = local_flat(param)
    return start, local.numel()


def _zero_disallowed(flat: torch.Tensor, entry: _Restricted) -> None:
    """Zero the disallowed entries of ``entry`` in ``flat`` (its gradient, or this process's part of it), in place."""
    if entry.indices is None:
        flat.zero_()
    elif entry.inside_allowed:
        kept = flat[entry.indices]
        flat.zero_()
        flat[entry.indices] = kept
    else:
        flat.index_fill_(0, entry.indices, 0)


def _zeroing_hook(entry: _Restricted):
    """A hook run once a gradient is accumulated into ``param.grad``: zero its disallowed entries there, in place."""

    def zero_disallowed(param: torch.Tensor) -> None:
        if not is_sharded(param.grad) and not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()
        _zero_disallowed(local_flat(param.grad)[0], entry)  # under FSDP2 the hook runs on the reduced shard

    return zero_disallowed


def restrict_training(
    model: nn.Module, allowed: Region | None = None, frozen: Region | None = None
) -> TrainingRestriction:
    """Restrict a custom training loop: ``restriction.step(optimizer)`` replaces ``optimizer.step()``.

    See :class:`TrainingRestriction` for ``allowed``/``frozen`` and the guarantee.
    """
    return TrainingRestriction(model, allowed, frozen)


class RestrictTrainingCallback(TrainerCallback):
    """Restrict any ``Trainer`` run to a region: ``Trainer(..., callbacks=[RestrictTrainingCallback(allowed=...)])``.

    See :class:`TrainingRestriction`. The hooks are attached when training begins and removed when it ends, also
    when it ends with an error.
    """

    def __init__(self, allowed: Region | None = None, frozen: Region | None = None) -> None:
        self.allowed, self.frozen = allowed, frozen
        self.restriction: TrainingRestriction | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.restriction = TrainingRestriction(model, self.allowed, self.frozen)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.restriction.before_step(optimizer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.restriction.after_step()

    def on_train_end(self, args, state, control, **kwargs):
        self._detach()

    def on_train_error(self) -> None:
        """Called by this package's wrapper of ``Trainer.train`` when it raises (the Trainer has no such event):
        detach the hooks, so that a later run of the model is not restricted."""
        self._detach()

    def _detach(self) -> None:
        if self.restriction is not None:
            self.restriction.remove()
            self.restriction = None
