"""The steps a Checkpointer keeps in host memory (`memory_every=N`), beside the ones on disk.

The Checkpointer asks one object, whether or not it was made with `memory_every`: is a snapshot
due at this step, which snapshot step the ranks agree on, is it newer than the disk's newest,
restore it, forget what a load from disk abandons. The snapshots themselves (slots, copies,
agreement, checks) are memory_snapshots.py's; this module holds the rules a Checkpointer follows
with them, so that without a snapshot store every answer is "none" and the Checkpointer has no
branch of its own for it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdp2nb.checkpoint.loadable_steps import LoadableSteps
from fsdp2nb.checkpoint.memory_snapshots import MemorySnapshots, open_snapshots, store_of_this_rank
from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.checkpoint.state import snapshot_training_state
from fsdp2nb.errors import CheckpointLoadError, UsageMistake
from fsdp2nb.host.memory_store import MEMORY_DIR_ENV


def snapshot_store(memory_every: int | None) -> str | None:
    """This rank's snapshot store (None outside a pool); refuses `memory_every` without one."""
    store = store_of_this_rank()
    if memory_every is not None and store is None:
        raise UsageMistake(f"memory_every={memory_every}: snapshots need host memory that outlives the ranks, "
                           f"which a pool provides: run this in a %%fsdp2 cell (or set {MEMORY_DIR_ENV} "
                           "to a directory on a tmpfs)")
    return store


class MemorySteps:
    """One Checkpointer's snapshots in host memory, as its save, load and listing see them."""

    def __init__(self, directory: Path, disk: LoadableSteps, memory_every: int | None,
                 snapshots: MemorySnapshots | None, *, rank: int) -> None:
        self._directory, self._disk, self._every, self._rank = directory, disk, memory_every, rank
        self._snapshots = snapshots
        """Snapshots in host memory: taken with memory_every, or restorable from an earlier pool."""
        self._agreed_at_track: int | None = None
        """The snapshot step the ranks agreed on at `track()` (what `latest()` counts)."""

    @classmethod
    def open(cls, store: str | None, directory: Path, disk: LoadableSteps, memory_every: int | None, *,
             rank: int, world_size: int, group: dist.ProcessGroup | None) -> MemorySteps:
        """Collective with a store: on every rank alike, or on none."""
        snapshots = None
        if store is not None:
            snapshots = open_snapshots(store, directory, wanted=memory_every is not None, rank=rank,
                                       world_size=world_size, group=group)
        return cls(directory, disk, memory_every, snapshots, rank=rank)

    @property
    def snapshots(self) -> MemorySnapshots | None:
        """The snapshots themselves (their counters are what the benchmarks read)."""
        return self._snapshots

    @property
    def taken(self) -> bool:
        """Whether snapshots are taken (memory_every): the optimizer's step then waits for their copy."""
        return self._every is not None

    def due(self, step: int) -> bool:
        return self._every is not None and step % self._every == 0

    def take(self, tracked: Tracked, step: int, *, wait_for_copy: bool) -> None:
        assert self._snapshots is not None, "made with memory_every"
        self._snapshots.take(tracked, step)
        if wait_for_copy:
            self._snapshots.wait()

    def wait(self) -> None:
        """Until the snapshot in flight (if any) is in host memory."""
        if self._snapshots is not None:
            self._snapshots.wait()

    def restore_if_newer(self, tracked: Tracked) -> int | None:
        """At `track()`, after a pool restart: restore the snapshot the ranks hold when the disk has
        nothing newer; returns the step restored."""
        if self._snapshots is None:
            return None
        self._snapshots.forget_live()
        self._agreed_at_track = step = self._snapshots.agreed_step(unless_own=True)
        on_disk = self._disk.latest_valid_step()
        if step is not None and (on_disk is None or step > on_disk):
            return self._restore(tracked, step, on_disk)
        return None

    def restore(self, tracked: Tracked, step: int) -> int:
        """Restore `step`, one that `step_to_load` gave; returns it."""
        return self._restore(tracked, step, self._disk.latest_valid_step())

    def _restore(self, tracked: Tracked, step: int, on_disk: int | None) -> int:
        assert self._snapshots is not None, "a step to restore was agreed on"
        started = time.perf_counter()
        self._snapshots.restore(tracked, step)
        if self._rank == 0:
            disk = f"the disk's newest is step {on_disk}" if on_disk is not None else "the disk has no checkpoint"
            print(f"restored step {step} from memory in {time.perf_counter() - started:.1f} s; {disk}", flush=True)
        return step

    def step_to_load(self, target: int | str | os.PathLike) -> int | None:
        """The snapshot step `load(target)` restores: "memory" asks for it (refused in one line
        without one), "latest" takes it when it is newer than the disk's newest."""
        memory = self._snapshots
        if target != "memory" and (target != "latest" or memory is None):
            return None
        if memory is not None:
            memory.wait()
        step = memory.agreed_step() if memory is not None else None
        if target == "memory":
            if step is None:
                raise CheckpointLoadError(self._no_snapshot() + "; nothing was loaded")
            return step
        on_disk = self._disk.latest_valid_step()
        return step if step is not None and (on_disk is None or step > on_disk) else None

    def forget_after_disk_load(self) -> None:
        """Snapshots after the step loaded from disk belong to the run that load abandons."""
        if self._snapshots is not None:
            self._snapshots.forget_live()
            self._snapshots.invalidate()

    def latest(self, on_disk: int | None) -> int | None:
        """The step `load("latest")` restores: the snapshot `track()` found where newer than `on_disk`."""
        found = self._agreed_at_track
        return found if found is not None and (on_disk is None or found > on_disk) else on_disk

    def newest_step(self) -> int | None:
        return self._snapshots.newest_step() if self._snapshots is not None else None

    def state_to_write(self, tracked: Tracked) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """The newest snapshot every rank holds, as a save writes it: (step, DCP state, rank state)."""
        memory = self._snapshots
        step = memory.agreed_step() if memory is not None else None
        if memory is None or step is None:
            raise CheckpointLoadError(self._no_snapshot() + "; nothing was written")
        memory.wait()
        views, other = memory.saved_views(step)
        state = snapshot_training_state(tracked, views, other["param_groups"])
        rank_state = {"step": step, "rng": other["rng"], "scheduler": other["scheduler"], "extra": other["extra"]}
        return step, state, rank_state

    def _no_snapshot(self) -> str:
        if self._snapshots is None:
            return (f"no snapshot of {self._directory} is kept in host memory (make the Checkpointer with "
                    "memory_every=N, in a %%fsdp2 cell)")
        return self._snapshots.describe_missing()

    def close(self) -> None:
        if self._snapshots is not None:
            self._snapshots.close()
