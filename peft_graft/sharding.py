"""Parameters sharded by FSDP2 (``fully_shard``), as the graft code reads and writes them outside a forward.

FSDP2 keeps each parameter of a sharded module as a ``DTensor`` sharded on dim 0 over a 1-D mesh: every process holds
a contiguous run of rows (``torch.chunk``'s split; trailing processes may hold none), and gathers whole tensors only for
its forward and backward. Outside them, code that reads or writes parameter entries by flat index works on this
process's run: :func:`local_flat` gives it and where it starts, :func:`read_entries` reads entries anywhere (one small
collective). Plain tensors pass through unchanged, so the same code serves one process, DDP and FSDP2.
"""

from __future__ import annotations

import math

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
    """``tensor`` whole, gathered from every process when FSDP2 shards it (a collective then)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def write_entries(param: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` at flat ``indices`` of ``param`` (cast to its dtype), into this process's shard under FSDP2:
    every process is given all of them and writes those it holds."""
    flat, start = local_flat(param)
    indices = indices.to(flat.device, torch.int64)
    values = values.to(flat.device, flat.dtype)
    if is_sharded(param):
        held = (indices >= start) & (indices < start + flat.numel())
        indices, values = indices[held] - start, values[held]
    with torch.no_grad():
        flat[indices] = values
