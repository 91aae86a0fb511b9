"""Recompute non-persistent buffers (rotary `inv_freq`) that a meta-built model never had.

They are not in the checkpoint and `to_empty` leaves them uninitialised, so each owning module is
rebuilt from its config, running the module's own init logic. It runs on CPU, as
`from_pretrained` does, so the values are bit-identical to a normally loaded model, and the
result is then moved to the model's device.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def non_persistent_buffer_names(model: nn.Module) -> list[str]:
    """Names of buffers that `state_dict()` leaves out."""
    persistent = set(model.state_dict(keep_vars=True))
    return [name for name, _ in model.named_buffers(remove_duplicate=False) if name not in persistent]


@torch.no_grad()
def recompute_non_persistent_buffers(model: nn.Module, device: torch.device) -> list[str]:
    """Refill every non-persistent buffer on `device`; returns the names refilled."""
    by_module: dict[str, list[str]] = {}
    for name in non_persistent_buffer_names(model):
        owner, _, buffer = name.rpartition(".")
        by_module.setdefault(owner, []).append(buffer)
    for owner, buffers in by_module.items():
        module = model.get_submodule(owner)
        fresh = _rebuild_on_cpu(module, owner, buffers)
        for buffer in buffers:
            module.register_buffer(buffer, getattr(fresh, buffer).to(device), persistent=False)
    refilled = [f"{owner}.{b}" if owner else b for owner, bs in by_module.items() for b in bs]
    logger.debug("recomputed non-persistent buffers: %s", refilled)
    return refilled


def _rebuild_on_cpu(module: nn.Module, owner: str, buffers: list[str]) -> nn.Module:
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(
            f"cannot recompute non-persistent buffers {buffers} of {owner!r} ({type(module).__name__}): "
            "the module has no config to rebuild it from; load this model with init='rank0'"
        )
    with torch.device("cpu"):
        return type(module)(config)
