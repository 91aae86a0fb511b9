"""Gradient clipping for fully_shard-ed models, with torch's signature."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2nb.errors import InvalidValue


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor | nn.Module, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor | float:
    """Scale gradients so that their global norm is at most `max_norm`; return the norm before clipping.

    Called on every rank after `backward()`, as torch's: `fsdp2nb.clip_grad_norm_(model.parameters(), 1.0)`.
    Returns a plain 0-d tensor on the gradients' device, the same on every rank; reading it
    (`.item()`) is the caller's choice, so a training step need not wait for the device.

    `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` gives the same norm and the same
    clipping on FSDP2 models, on the flat mesh and on HSDP's (tests/distributed/test_clip_grad_norm.py):
    DTensor reduces the shards' partial norm, along "shard" only on HSDP, where the replicas hold the
    same gradients. It returns that norm as a replicated DTensor; this function returns it as a plain
    tensor, so that code written for one process (a comparison, `torch.isfinite`, a logger) takes it as is.

    A module in place of `parameters` is the spelling of earlier releases: it clips the module's
    parameters and returns the norm as a float, as it did then (one host sync per call).
    """
    from_module = isinstance(parameters, nn.Module)
    if from_module:
        parameters = parameters.parameters()
    elif not isinstance(parameters, (torch.Tensor, Iterable)):
        raise InvalidValue(f"parameters={type(parameters).__name__} is not allowed; pass model.parameters() "
                           "(an iterable of tensors), one tensor, or the module")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, error_if_nonfinite, foreach)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return float(total.item()) if from_module else total
