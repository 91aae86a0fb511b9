"""Gradient clipping for fully_shard-ed models."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale gradients so their global norm is at most `max_norm`; return the norm before clipping.

    Called on every rank after `backward()`, as `fsdp2nb.clip_grad_norm_(model, 1.0)`.

    Gradients are DTensor shards; their local norms are combined across ranks by DTensor
    (`full_tensor()` reduces the partial norm), so the result equals the single-process norm.
    On an HSDP mesh the gradients are `(Replicate(), Shard(0))`: the norm is partial along
    "shard" only, so it is summed within a row and not again across the replicas, which hold
    the same gradients after FSDP2's all-reduce.
    With CPU offload the shards live on CPU and that reduction runs on the CPU (gloo) backend.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=None)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
    return float(total.item())
