"""Recompute non-persistent buffers (rotary `inv_freq`, Gemma's `embed_scale`) that a meta-built
model never had.

They are not in the checkpoint and `to_empty` leaves them uninitialised. transformers 5 fills
them the way `from_pretrained` does: the model's own `_init_weights` on each owning module, with
the module's parameters flagged as initialised so that only the buffers are written. Where that
is not available (transformers 4) or leaves a buffer unset, the owning module is rebuilt on CPU
from its config, which runs the module's own init logic.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from fsdp2nb.errors import NotSupported, UsageMistake
from fsdp2nb.module_buffers import non_persistent_buffer_names

logger = logging.getLogger(__name__)


@torch.no_grad()
def recompute_non_persistent_buffers(model: nn.Module, device: torch.device) -> list[str]:
    """Refill every non-persistent buffer on `device`; returns the names refilled."""
    by_module: dict[str, list[str]] = {}
    for name in non_persistent_buffer_names(model):
        owner, _, buffer = name.rpartition(".")
        by_module.setdefault(owner, []).append(buffer)
    init_weights = _buffer_initializer(model)
    for owner, buffers in by_module.items():
        module = model.get_submodule(owner)
        if init_weights is not None and _fill_through_init_weights(module, buffers, init_weights, device):
            continue
        fresh = _rebuild_on_cpu(module, owner, buffers)
        for buffer in buffers:
            module.register_buffer(buffer, getattr(fresh, buffer).to(device), persistent=False)
    refilled = [f"{owner}.{b}" if owner else b for owner, bs in by_module.items() for b in bs]
    logger.debug("recomputed non-persistent buffers: %s", refilled)
    return refilled


def _buffer_initializer(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """The transformers model's `_init_weights`, where its init functions skip flagged tensors."""
    try:
        import transformers.initialization  # noqa: F401 - transformers 5: init functions honour the flag
    except ImportError:
        return None
    hf_model = model.get_base_model() if hasattr(model, "peft_config") else model
    return getattr(hf_model, "_init_weights", None)


def _fill_through_init_weights(module: nn.Module, buffers: list[str], init_weights: Callable[[nn.Module], None],
                               device: torch.device) -> bool:
    """Fill `module`'s buffers with `init_weights`; False if one was left unset."""
    for name in buffers:  # on `device`, each marked so that a buffer left unset shows
        buffer = getattr(module, name)
        marked = torch.empty_like(buffer, device=device)
        marked.fill_(float("nan") if marked.is_floating_point() else 0)
        module.register_buffer(name, marked, persistent=False)
    loaded = [*module.parameters(), *(t for n, t in module.named_buffers() if n not in buffers)]
    versions = [t._version for t in loaded]
    with _flagged_initialised(loaded):
        init_weights(module)
    if [t._version for t in loaded] != versions:  # it wrote a loaded tensor: such a model cannot take this path
        raise NotSupported(f"{type(module).__name__}._init_weights changed loaded weights while filling {buffers}; "
                           "load this model with init='default'")
    unset = [name for name in buffers if _still_marked(getattr(module, name))]
    if unset:
        logger.debug("%s left %s unset; rebuilding the module", type(module).__name__, unset)
    return not unset


def _still_marked(buffer: torch.Tensor) -> bool:
    if buffer.is_floating_point():
        return bool(torch.isnan(buffer).any())
    return not bool(buffer.any())  # an all-zero integer buffer is rebuilt to be sure


@contextlib.contextmanager
def _flagged_initialised(tensors: list[torch.Tensor]):
    """transformers' init functions leave alone a tensor flagged `_is_hf_initialized`."""
    flagged = [t for t in tensors if not getattr(t, "_is_hf_initialized", False)]
    for tensor in flagged:
        tensor._is_hf_initialized = True
    try:
        yield
    finally:
        for tensor in flagged:
            del tensor._is_hf_initialized


def _rebuild_on_cpu(module: nn.Module, owner: str, buffers: list[str]) -> nn.Module:
    config = getattr(module, "config", None)
    if config is None:
        raise UsageMistake(
            f"cannot recompute non-persistent buffers {buffers} of {owner!r} ({type(module).__name__}): "
            "the module has no config to rebuild it from; load this model with init='default'"
        )
    with torch.device("cpu"):
        return type(module)(config)
