"""Checkpoints of FSDP2 training runs: atomic DCP saves, async writes, retention and HF export.

    from fsdp2nb.checkpoint import Checkpointer
    ckpt = Checkpointer("/ckpt/run1", keep=3).track(model=model, optimizer=optimizer)
"""

from fsdp2nb.checkpoint.hf_export import export_hf_model
from fsdp2nb.checkpoint.layout import CheckpointEntry, CheckpointMetadata
from fsdp2nb.checkpoint.manager import (
    Checkpointer,
    CheckpointSaveError,
    CheckpointStatus,
    tracked_checkpointer,
)
from fsdp2nb.checkpoint.requests import SaveRequests, post_save_request
from fsdp2nb.checkpoint.state import CheckpointMismatchError, load_training_state, save_training_state

__all__ = [
    "CheckpointEntry",
    "CheckpointMetadata",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CheckpointStatus",
    "Checkpointer",
    "SaveRequests",
    "export_hf_model",
    "load_training_state",
    "post_save_request",
    "save_training_state",
    "tracked_checkpointer",
]
