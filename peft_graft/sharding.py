"""Parameters sharded by FSDP2 (``fully_shard``), as the graft code reads and writes them outside a forward.

FSDP2 keeps each parameter of a sharded module as a ``DTensor`` sharded on dim 0 over a 1-D mesh: every process holds
a contiguous run of rows (``torch.chunk``'s split; trailing processes may hold none), and gathers whole tensors only for
its forward and backward. Outside them, code that reads or writes parameter entries by flat index works on this
process's run: :func:`local_flat` gives it and where it starts, :func:`read_entries` reads entries anywhere (one small
collective). Plain tensors pass through unchanged, so the same code serves one process, DDP and FSDP2.

DeepSpeed ZeRO-3 partitions each parameter into a flat piece per process and leaves an empty placeholder in the module
outside the forward of the module that owns it (or of one that registered it as an external parameter).
:func:`gathered` makes such parameters whole around a read (a collective); :func:`read_entries` and :func:`whole` gather
them themselves.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bit patterns, as a view of the signed integer type of its element size (compared this way, a NaN
    equals itself; summed, the patterns of entries held by one process each add up to theirs)."""
    return tensor.view(_INT_VIEW[tensor.element_size()])


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter, or its gradient, sharded by FSDP2)."""
    return type(tensor).__name__ == "DTensor" or type(getattr(tensor, "data", None)).__name__ == "DTensor"


def local_flat(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(flat view of this process's entries, flat index of the first)``: the whole tensor and 0 when it is not
    sharded. Writing into the view writes into the parameter (or gradient)."""
    if not is_sharded(tensor):
        return tensor.detach().reshape(-1), 0  # a view when contiguous (parameters and gradients are)
    from torch.distributed.tensor import Shard

    placements, mesh = tensor.placements, tensor.device_mesh
    if mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(
            f"A parameter is sharded as {placements} over a {mesh.ndim}-D mesh; peft_graft reads FSDP2 parameters "
            "sharded on dim 0 over one mesh dimension (fully_shard without HSDP or tensor parallelism)."
        )
    local = tensor.to_local().detach()
    rows, world, rank = tensor.shape[0], mesh.size(), mesh.get_local_rank()
    first_row = min(rank * -(-rows // world), rows)
    row_size = math.prod(tensor.shape[1:])
    return local.reshape(-1) if not local.is_contiguous() else local.view(-1), first_row * row_size


def read_entries(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``tensor`` flattened at ``indices`` (int), bit for bit, on every process. For a sharded tensor this is a
    collective (every process calls it, in the same order): each fills in the entries it holds and an integer sum
    of the bit patterns, zero elsewhere, hands every process all of them."""
    if is_partitioned(tensor):
        with gathered([tensor]):
            return tensor.detach().reshape(-1)[indices.to(tensor.device, torch.int64)].clone()
    if not is_sharded(tensor):
        return tensor.detach().reshape(-1)[indices.to(tensor.device, torch.int64)]
    flat, start = local_flat(tensor)
    indices = indices.to(flat.device, torch.int64)
    held = (indices >= start) & (indices < start + flat.numel())
    bits = torch.zeros(indices.numel(), dtype=_INT_VIEW[flat.element_size()], device=flat.device)
    bits[held] = as_bits(flat[indices[held] - start])
    summed = bits.to(torch.int64)
    dist.all_reduce(summed, group=tensor.device_mesh.get_group())
    return summed.to(bits.dtype).view(flat.dtype)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole, gathered from every process when FSDP2 shards it or ZeRO-3 partitions it (a collective
    then; a copy for ZeRO-3)."""
    if is_partitioned(tensor):
        with gathered([tensor]):
            return tensor.detach().clone()
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def write_entries(param: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` at flat ``indices`` of ``param`` (cast to its dtype), into this process's shard under FSDP2 or
    partition under ZeRO-3: every process is given all of them and writes those it holds (no collective)."""
    if is_partitioned(param):
        _write_partition(param, indices, values)
        return
    flat, start = local_flat(param)
    indices = indices.to(flat.device, torch.int64)
    values = values.to(flat.device, flat.dtype)
    if is_sharded(param):
        held = (indices >= start) & (indices < start + flat.numel())
        indices, values = indices[held] - start, values[held]
    with torch.no_grad():
        flat[indices] = values


def _write_partition(param: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`write_entries` for a ZeRO-3 partitioned ``param``: into this process's partition (``ds_tensor``), which
    gathers and the next DeepSpeed engine (a Trainer's next run) start from, and into the whole data of a parameter
    gathered now (ZeRO-3 keeps small ones gathered between steps). An engine already built keeps its own fp32 copy of
    the partition: write between training runs."""
    start, count = partition_span(param)
    indices, values = indices.to(torch.int64).cpu(), values.cpu()
    held = (indices >= start) & (indices < start + count)
    part = param.ds_tensor.view(-1)
    with torch.no_grad():
        part[(indices[held] - start).to(part.device)] = values[held].to(part.device, part.dtype)
        if is_gathered(param):
            param.data.view(-1)[indices.to(param.device)] = values.to(param.device, param.dtype)


def is_partitioned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter DeepSpeed ZeRO-3 partitions (its data a placeholder outside
    ``deepspeed.zero.GatheredParameters``; its real shape ``ds_shape``)."""
    return hasattr(tensor, "ds_id")


def is_gathered(tensor: torch.Tensor) -> bool:
    """Whether a ZeRO-3 partitioned ``tensor`` holds its whole data now (inside the forward that fetched it, or
    :func:`gathered`)."""
    return getattr(tensor, "ds_status", None) is not None and tensor.ds_status.name == "AVAILABLE"  # not INFLIGHT


@contextlib.contextmanager
def gathered(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Within this context, the ZeRO-3 partitioned ones among ``tensors`` are whole on every process, for reading:
    ``deepspeed.zero.GatheredParameters`` (a collective: every process enters it, in the same order) over those not
    already whole (whole ones stay as they are: re-partitioning them would pull them from under a running forward).
    Nothing happens for plain, DDP or FSDP2 tensors."""
    partitioned = [tensor for tensor in tensors if is_partitioned(tensor) and not is_gathered(tensor)]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


def sharding_engine(tensors) -> tuple[str, str] | None:
    """``(engine, name)`` of the first of the named ``tensors`` (``(name, tensor)`` pairs) sharded by FSDP2 or
    partitioned by DeepSpeed ZeRO-3 (and not :func:`gathered` now), or ``None`` when all are whole."""
    for name, tensor in tensors:
        if is_sharded(tensor):
            return "FSDP2", name
        if is_partitioned(tensor) and not is_gathered(tensor):
            return "DeepSpeed ZeRO-3", name
    return None


def refuse_sharded(tensors, action: str, way_out: str) -> None:
    """A ``ValueError`` saying that ``action`` needs whole tensors and naming ``way_out`` when one of the named
    ``tensors`` is sharded (FSDP2) or partitioned (ZeRO-3); nothing when all are whole."""
    found = sharding_engine(tensors)
    if found is not None:
        engine, name = found
        raise ValueError(
            f"{action} needs the model's tensors whole, but {engine} shards them (e.g. {name!r}) and peft_graft does "
            f"not gather them for it: {way_out} See docs/fsdp.md."
        )


DEEPSPEED_REFUSAL = (
    "peft_graft supports DeepSpeed only at ZeRO-3 (TrainingArguments(deepspeed=<ZeRO-3 config>) or an accelerate "
    "config), for learning a region with MaskTrainer, restricted training (RestrictTrainingCallback), continual "
    "learning (ContinualGrafter) and creating, loading and saving a graft on a model ZeRO-3 partitioned (loaded under "
    "zero.Init). ZeRO-3 partitions every parameter and gathers a module's parameters only around that module's "
    "forward, while merging reads and writes them whole; ZeRO-1/2 step flat fp32 copies of the parameters, which a "
    "hardened region would not reach. Use FSDP2 (fully_shard: Trainer fsdp=True with fsdp_config={'version': 2}, or "
    "an accelerate config with fsdp_version: 2), which shards the frozen model, or DDP; see docs/fsdp.md."
)


def deepspeed_engine(model: torch.nn.Module | None = None, running: bool = True) -> str | None:
    """``"DeepSpeed ZeRO-3"`` when a parameter of ``model`` is partitioned; with ``running``, ``"DeepSpeed"`` when
    accelerate runs DeepSpeed (a Trainer's ``deepspeed`` argument or an accelerate config); ``None`` otherwise."""
    if model is not None and any(is_partitioned(param) for param in model.parameters()):
        return "DeepSpeed ZeRO-3"
    if not running:
        return None
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if AcceleratorState._shared_state and AcceleratorState().distributed_type == DistributedType.DEEPSPEED:
        return "DeepSpeed"
    return None


def refuse_deepspeed(action: str, model: torch.nn.Module | None = None, running: bool = True) -> None:
    """A ``ValueError`` naming ``action`` and the way out when ``model`` is partitioned by ZeRO-3 or (with
    ``running``) DeepSpeed runs."""
    engine = deepspeed_engine(model, running)
    if engine is not None:
        raise deepspeed_refusal(action, engine)


def zero_stage(model: torch.nn.Module | None = None) -> int | None:
    """The ZeRO stage DeepSpeed runs: 3 when a parameter of ``model`` is partitioned, else the stage of the DeepSpeed
    run accelerate holds (a Trainer's ``deepspeed`` argument or an accelerate config); ``None`` without DeepSpeed."""
    engine = deepspeed_engine(model)
    if engine is None or engine == "DeepSpeed ZeRO-3":
        return None if engine is None else 3
    from accelerate.state import AcceleratorState

    return AcceleratorState().deepspeed_plugin.zero_stage


def deepspeed_refusal(action: str, engine: str = "DeepSpeed", reason: str = DEEPSPEED_REFUSAL) -> ValueError:
    """The error refusing ``action`` under ``engine`` (DeepSpeed), with ``reason`` and the way out."""
    return ValueError(f"{action} cannot run under {engine}: {reason}")


def full_numel(tensor: torch.Tensor) -> int:
    """The number of entries of ``tensor`` whole: ``ds_numel`` for a ZeRO-3 partitioned parameter (whose data is a
    placeholder), else ``numel()`` (a ``DTensor``'s counts the whole tensor)."""
    return tensor.ds_numel if is_partitioned(tensor) else tensor.numel()


def full_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of ``tensor`` whole: ``ds_shape`` for a ZeRO-3 partitioned parameter, else ``shape``."""
    return tensor.ds_shape if is_partitioned(tensor) else tensor.shape


def partition_span(param: torch.Tensor) -> tuple[int, int]:
    """``(flat index of the first entry, number of entries)`` of this process's partition of a ZeRO-3 partitioned
    ``param``: ZeRO-3 pads the flattened tensor to a multiple of the processes and hands process ``r`` the run of
    ``param.ds_tensor.ds_numel`` entries from ``r`` times that (the last runs hold padding, or nothing real)."""
    size = param.ds_tensor.ds_numel
    start = size * dist.get_rank(group=param.ds_process_group)
    return start, max(0, min(size, param.ds_numel - start))
