"""Rank 0's commit of a save that every rank finished: the step's metadata, its directory renamed
into place, then LATEST, then retention. A crash at any point leaves LATEST naming a complete step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from fsdp2nb.checkpoint import layout, provenance
from fsdp2nb.checkpoint.faults import fault_point
from fsdp2nb.checkpoint.layout import CheckpointMetadata
from fsdp2nb.checkpoint.state import has_frozen_params
from fsdp2nb.errors import SaveFilesMissing

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SaveJob:
    """One save: its step, and the temporary directory (named by `token`) it is written into."""

    step: int
    token: str
    tmp_dir: Path
    wall_time: float


def commit_step(job: SaveJob, directory: Path, model: nn.Module, *, world_size: int, keep: int | None,
                rank: int) -> None:
    """Rank 0 only: metadata, rename into place, LATEST, retention."""
    fault_point("before_metadata", rank)
    missing = layout.missing_files(job.tmp_dir, world_size)
    if missing:  # LATEST must never name a step that cannot be loaded
        raise SaveFilesMissing(f"{job.tmp_dir} lacks {', '.join(missing)} (is {directory} the same "
                               "directory on every host?)")
    layout.write_metadata(job.tmp_dir, _metadata(job, model, layout.record_files(job.tmp_dir), world_size))
    fault_point("before_rename", rank)
    layout.commit_step_dir(directory, job.tmp_dir, job.step, job.token)
    fault_point("before_latest", rank)
    layout.write_latest(directory, job.step)
    try:  # step N is committed whatever happens here
        deleted = layout.apply_retention(directory, keep, job.step, frozenset({job.step}))
    except OSError as exc:
        logger.warning("checkpoint step %d is committed, but removing older steps failed: %s", job.step, exc)
        return
    if deleted:
        logger.info("retention removed steps %s", deleted)


def _metadata(job: SaveJob, model: nn.Module, files: dict[str, list[int | None]], world_size: int) -> CheckpointMetadata:
    trainable_only = has_frozen_params(model)
    return CheckpointMetadata(
        step=job.step, world_size=world_size, wall_time=job.wall_time,
        trainable_only=trainable_only, versions=provenance.library_versions(),
        rebuild=provenance.rebuild_info(model) if trainable_only else {}, files=files,
    )
