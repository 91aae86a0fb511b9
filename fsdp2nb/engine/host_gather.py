"""The whole parameters of a sharded model on one rank only: what CPU ranks of one host use to
generate and evaluate.

CPU ranks of one host share its memory bus, and decoding reads every weight for every token: one
rank running the whole batch on every core reads them once per step, where each rank running its
part reads them once per rank. Only that rank needs the whole model, so every rank sends its shards
to it in one `gather` (each rank's shards flattened into one buffer), instead of FSDP2's unshard,
which all-gathers them into every rank. The root puts the whole tensors in place of the sharded
parameters until exit; the other ranks change nothing and hold no more memory.

Only for a 1-D mesh whose parameters are all `Shard(0)`, as `fully_shard` makes them; the root's
forward passes must run with FSDP2's hooks set aside (`inference.fsdp_forward_hooks_set_aside`),
which would otherwise unshard, a collective the other ranks never join.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def can_gather_on_one_rank(model: nn.Module) -> bool:
    """True where every parameter is a DTensor sharded along dim 0 of one 1-D mesh."""
    params = list(model.parameters())
    return bool(params) and all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.placements == (Shard(0),)
                                for p in params)


@contextlib.contextmanager
def whole_on_one_rank(model: nn.Module, root: int, dtype: torch.dtype | None) -> Iterator[None]:
    """On `root`, every parameter whole (in `dtype` where given, for floating point ones) until
    exit; collective: every rank sends its shards. The model must be resharded on entry."""
    params = _unique_params(model)
    group = params[0].device_mesh.get_group()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    group_root = dist.get_group_rank(group, root)
    rows = [_rows_per_rank(param.shape[0], world) for param in params]
    flat = _flat_shards(params, rows, me, world)
    received = [torch.empty_like(flat) for _ in range(world)] if me == group_root else None
    dist.gather(flat, received, dst=root, group=group)
    if received is None:
        yield
        return
    whole = _whole_tensors(params, rows, received, dtype)
    swapped = _swap(model, whole)
    try:
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def _unique_params(model: nn.Module) -> list[DTensor]:
    """Each parameter once (tied ones share one), in the model's order."""
    seen: dict[int, DTensor] = {}
    for param in model.parameters():
        seen.setdefault(id(param), param)
    return list(seen.values())


def _rows_per_rank(num_rows: int, world: int) -> list[int]:
    """Rows of dim 0 on each rank, as torch.chunk splits them (FSDP2's and DTensor's rule)."""
    chunk = -(-num_rows // world)
    return [max(0, min(chunk, num_rows - rank * chunk)) for rank in range(world)]


def _flat_shards(params: list[DTensor], rows: list[list[int]], me: int, world: int) -> torch.Tensor:
    """This rank's shards, flattened one after the other, padded to the longest rank's length."""
    def rank_numel(rank: int) -> int:
        return sum(param_rows[rank] * math.prod(param.shape[1:]) for param, param_rows in zip(params, rows, strict=True))
    longest = max(rank_numel(rank) for rank in range(world))
    flat = torch.zeros(longest, dtype=params[0].dtype, device=params[0].to_local().device)
    offset = 0
    for param in params:
        local = param.to_local().reshape(-1)
        flat[offset:offset + local.numel()] = local
        offset += local.numel()
    return flat


def _whole_tensors(params: list[DTensor], rows: list[list[int]], received: list[torch.Tensor],
                   dtype: torch.dtype | None) -> dict[int, nn.Parameter]:
    """Each parameter whole, made of every rank's rows in rank order; keyed by the sharded one's id."""
    offsets = [0] * len(received)
    whole = {}
    for param, param_rows in zip(params, rows, strict=True):
        row_numel = math.prod(param.shape[1:])
        parts = []
        for rank, num_rows in enumerate(param_rows):
            parts.append(received[rank][offsets[rank]:offsets[rank] + num_rows * row_numel])
            offsets[rank] += num_rows * row_numel
        tensor = torch.cat(parts).view(param.shape)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        whole[id(param)] = nn.Parameter(tensor, requires_grad=False)
    return whole


def _swap(model: nn.Module, whole: dict[int, nn.Parameter]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """The whole tensors in place of the sharded parameters; what was there, to put back."""
    swapped = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in whole:
                swapped.append((module, name, param))
                module._parameters[name] = whole[id(param)]
    return swapped
