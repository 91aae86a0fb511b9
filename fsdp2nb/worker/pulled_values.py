"""What a rank sends the notebook for `%fsdp2 pull`: plain values as they are, a DTensor whole.

Every rank of the pool takes part in a pull, because a DTensor's pieces live on all of them.
Its full tensor is needed only on the ranks that reply, so a row-sharded DTensor (one `Shard`
over the whole world, as FSDP2 shards parameters) is gathered to the replying rank alone: the
others hold one shard at any time, not the whole tensor as `full_tensor()` would make them.
Other layouts (several mesh dimensions, partial sums, strided shards) take `full_tensor()`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from fsdp2nb.collectives import all_max
from fsdp2nb.errors import UsageMistake


def value_for_notebook(value: Any, reply_ranks: tuple[int, ...]) -> Any:
    """`value` as the notebook should receive it; for a DTensor, None on ranks that do not reply.

    Called on every rank of the pool for the same name (pass None where it is not defined).
    Raises ValueError on every rank when the value is a DTensor on some ranks only: gathering
    it would wait forever for the ranks that do not take part."""
    if _is_dtensor_everywhere(isinstance(value, DTensor)):
        value = _full_on(value, reply_ranks)
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        value = value.cpu()
    return value


def _is_dtensor_everywhere(is_dtensor: bool) -> bool:
    """Whether every rank holds a DTensor; ValueError if only some do."""
    highest, negated_lowest = all_max((int(is_dtensor), -int(is_dtensor)))  # gloo carries it on every pool
    if highest != -negated_lowest:
        raise UsageMistake("it is a DTensor on some ranks only, so its pieces cannot be gathered; "
                           "make it a DTensor on every rank, or a plain value on every rank")
    return bool(highest)


def _full_on(tensor: DTensor, reply_ranks: tuple[int, ...]) -> torch.Tensor | None:
    shard_dim = _world_shard_dim(tensor)
    if shard_dim is None or len(reply_ranks) != 1:
        return tensor.full_tensor()
    return _gather_shards(tensor.to_local(), tensor.shape[shard_dim], shard_dim, tensor.device_mesh, reply_ranks[0])


def _world_shard_dim(tensor: DTensor) -> int | None:
    """The dimension a DTensor is split along over every rank, in rank order; else None."""
    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim != 1 or type(placements[0]) is not Shard:  # a subclass (strided shard) lays out differently
        return None
    if mesh.mesh.tolist() != list(range(dist.get_world_size())):
        return None
    return placements[0].dim % tensor.ndim


def _gather_shards(local: torch.Tensor, length: int, dim: int, mesh, destination: int) -> torch.Tensor | None:
    """Gather the shards of a tensor split along `dim` as torch.chunk splits it, onto `destination`.

    Shards differ in length only along `dim` (the last ones may be shorter, or empty): each is
    padded to the first's length for the gather, and cut back on arrival."""
    world = mesh.size()
    chunk = -(-length // world)
    padded = local.contiguous()
    if local.shape[dim] != chunk:
        padded = local.new_zeros(*local.shape[:dim], chunk, *local.shape[dim + 1:])
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    rank = dist.get_rank()
    received = [torch.empty_like(padded) for _ in range(world)] if rank == destination else None
    dist.gather(padded, received, dst=destination, group=mesh.get_group())
    if received is None:
        return None
    lengths = [max(0, min(chunk, length - i * chunk)) for i in range(world)]
    return torch.cat([piece.narrow(dim, 0, n) for piece, n in zip(received, lengths, strict=True)], dim)
