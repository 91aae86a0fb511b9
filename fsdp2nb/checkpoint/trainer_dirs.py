"""A Hugging Face Trainer's `checkpoint-N` directories, as the dashboard lists them.

`fsdp2nb.TrainerCallback` lists its Trainer's output directory on rank 0 when training begins and
after each save (Trainer has rotated old ones away by then) and publishes the listing here; the
ranks' sampler sends the last one with each snapshot. Listing only then keeps the directory walk
off the sampler's timer. No torch: the sampler reads this module.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fsdp2nb.checkpoint.layout import dir_size
from fsdp2nb.wire.records import CheckpointEntry, CheckpointStatus

DCP_DIR = "fsdp2nb_dcp"
"""The folder of a Trainer checkpoint that holds the sharded model and optimizer state."""

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")

_published: CheckpointStatus | None = None


def list_trainer_checkpoints(output_dir: str) -> CheckpointStatus:
    """Every `checkpoint-N` under `output_dir`, oldest first. One is complete when Trainer wrote
    its state and DCP its metadata (`fsdp2nb_dcp/.metadata` is written last, after every rank's
    shards); `world_size` counts the ranks' shard files."""
    output_dir = os.path.abspath(output_dir)
    entries = []
    for step, path in _checkpoint_dirs(output_dir):
        state = os.path.join(path, TRAINER_STATE)
        dcp_dir = os.path.join(path, DCP_DIR)
        shards = [n for n in _names(dcp_dir) if n.endswith(".distcp")]
        valid = os.path.isfile(state) and os.path.isfile(os.path.join(dcp_dir, ".metadata")) and _readable_json(state)
        entries.append(CheckpointEntry(step=step, path=path, wall_time=_mtime(state), size_bytes=dir_size(Path(path)),
                                       world_size=len(shards) or None, valid=valid))
    latest = max((e.step for e in entries if e.valid), default=None)
    return CheckpointStatus(directory=output_dir, latest_step=latest, saving_step=None, last_error=None,
                            entries=tuple(entries))


def publish(status: CheckpointStatus) -> None:
    """Make `status` the listing the sampler sends."""
    global _published
    _published = status


def published() -> CheckpointStatus | None:
    """The last listing a TrainerCallback published in this process, or None."""
    return _published


def _checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    found = []
    for name in _names(output_dir):
        match = _CHECKPOINT_NAME.fullmatch(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:  # not there (yet), or removed while listed
        return []


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _readable_json(path: str) -> bool:
    try:
        with open(path) as handle:
            json.load(handle)
    except (OSError, ValueError):  # a save that died while writing it
        return False
    return True
