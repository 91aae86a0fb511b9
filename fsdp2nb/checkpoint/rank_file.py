"""Each rank's own file of a checkpoint (`rank-NNNNN.pt`): its step, its RNG streams, and the state
of the scheduler and of the extra objects `Checkpointer.track` named, which DCP does not save.
Captured as deep copies when a save starts (training goes on changing the live objects), written
durably beside the shards, and read back on every rank before a load touches a live tensor."""

from __future__ import annotations

import copy
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp2nb.checkpoint import layout
from fsdp2nb.checkpoint.layout import CheckpointMetadata
from fsdp2nb.checkpoint.rng import capture_rng_state, restore_rng_state, rng_streams_not_restored
from fsdp2nb.collectives import FailedElsewhere, all_ranks_succeeded, describe
from fsdp2nb.errors import CheckpointLoadError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    """What a checkpointer saves and restores, as `Checkpointer.track` named it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    extra: dict[str, Any]


def capture_rank_state(tracked: Tracked, step: int) -> dict[str, Any]:
    # Deep copies: training goes on mutating the live objects while this is written.
    return {
        "step": step,
        # False for a save before the first optimizer step (see state.training_state_to_save).
        "optimizer_stepped": tracked.optimizer is not None and bool(tracked.optimizer.state),
        "rng": capture_rng_state(),
        "scheduler": copy.deepcopy(tracked.scheduler.state_dict()) if tracked.scheduler else None,
        "extra": {name: copy.deepcopy(obj.state_dict()) for name, obj in tracked.extra.items()},
    }


def write_rank_state(step_dir: Path, rank: int, rank_state: dict[str, Any]) -> None:
    """The rank's file in `step_dir`, on disk (file and directory fsynced) when this returns."""
    buffer = io.BytesIO()
    torch.save(rank_state, buffer)
    layout.write_durable(step_dir / layout.rank_file_name(rank), buffer.getvalue())
    layout.fsync_dir(step_dir)


def read_rank_state_collectively(step_dir: Path, metadata: CheckpointMetadata, rank: int,
                                 group: dist.ProcessGroup | None) -> dict[str, Any]:
    """This rank's file of the step; a rank that cannot read its file fails the load on every
    rank, before the collective load that the others would otherwise wait in."""
    # A rank that did not exist at save time takes rank 0's file (scheduler and extras are the
    # same on every rank) and keeps its own generators (see restore_rank_state).
    source_rank = rank if rank < metadata.world_size else 0
    path = step_dir / layout.rank_file_name(source_rank)
    state, error = None, None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # damaged or unreadable; torch's advice (weights_only=False) is wrong here
        error = ValueError(f"{path} could not be read ({describe(exc)})")  # internal: raised below as CheckpointLoadError
    try:
        all_ranks_succeeded(error, "reading the checkpoint", group)
    except (ValueError, FailedElsewhere) as exc:
        raise CheckpointLoadError(f"checkpoint step {metadata.step} is damaged: {exc}; nothing was loaded. "
                                  "Load another step (see list())") from None
    return state


def restore_rank_state(tracked: Tracked, rank_state: dict[str, Any], metadata: CheckpointMetadata,
                       rank: int, world_size: int) -> None:
    if tracked.optimizer is not None and rank_state.get("optimizer_stepped") is False:
        tracked.optimizer.state.clear()  # the zeros DCP made it save: not an optimizer step
    if tracked.scheduler is not None and rank_state["scheduler"] is not None:
        tracked.scheduler.load_state_dict(rank_state["scheduler"])
    for name, obj in tracked.extra.items():
        if name in rank_state["extra"]:
            obj.load_state_dict(rank_state["extra"][name])
        else:
            logger.warning("checkpoint step %d has no state for %r", metadata.step, name)
    if rank < metadata.world_size:
        restore_rng_state(rank_state["rng"])
    unmapped = rng_streams_not_restored(metadata.world_size, world_size)
    if unmapped and rank == 0:
        logger.warning("checkpoint step %d: %s", metadata.step, unmapped)
