"""Which of a model's buffers its `state_dict()` keeps, read one way for the engine's loading
(non-persistent buffers are recomputed, not read) and for snapshots in host memory (persistent
ones are copied).

Each module's own flag says it: a whole `state_dict()` costs more, and a wrapper's state-dict
hooks (activation checkpointing's) rename its keys, so names compared with them would count every
buffer under the wrapper as non-persistent.
"""

from __future__ import annotations

import torch
from torch import nn


def buffers_by_persistence(model: nn.Module, *, persistent: bool,
                           remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """The buffers that `state_dict()` keeps (`persistent`) or leaves out, by qualified name;
    `remove_duplicate=False`: a module used twice is listed under each name."""
    found = {}
    for prefix, module in model.named_modules(remove_duplicate=remove_duplicate):
        for name, buffer in module._buffers.items():
            if buffer is not None and (name not in module._non_persistent_buffers_set) == persistent:
                found[f"{prefix}.{name}" if prefix else name] = buffer
    return found


def non_persistent_buffer_names(model: nn.Module) -> list[str]:
    """Names of buffers that `state_dict()` leaves out."""
    return list(buffers_by_persistence(model, persistent=False, remove_duplicate=False))
