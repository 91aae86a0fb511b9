"""Checkpoints of FSDP2 training runs: atomic DCP saves, async writes, retention and HF export.

    from fsdp2nb.checkpoint import Checkpointer
    ckpt = Checkpointer("/ckpt/run1", keep=3).track(model=model, optimizer=optimizer)

The names below are the public API, resolved on first use, so `fsdp2nb.checkpoint.tracking`
(which the ranks' sampler reads) can be imported without torch. The plumbing that the ranks
use (`tracking`, `requests`) is imported from its own module. The HF export is offered as
`fsdp2nb.export_hf` (`hf_export.py`).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_NAMES = {
    "CheckpointEntry": "fsdp2nb.wire.records",
    "CheckpointLoadError": "fsdp2nb.errors",
    "CheckpointMetadata": "fsdp2nb.checkpoint.layout",
    "CheckpointMismatchError": "fsdp2nb.errors",
    "CheckpointSaveError": "fsdp2nb.errors",
    "CheckpointStatus": "fsdp2nb.wire.records",
    "Checkpointer": "fsdp2nb.checkpoint.manager",
}

__all__ = sorted(_LAZY_NAMES)


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp2nb.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_NAMES])
