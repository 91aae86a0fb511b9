"""Persisting at the breakpoint, on the ranks: when their kernel is gone, write the newest snapshot
in host memory to disk as an ordinary checkpoint of its step, so that a new kernel's
`load("latest")` resumes there instead of at the last disk save.

Every rank of a pool that is not kept calls `persist_at_kernel_exit` once its request loop finds
the kernel gone (a running cell is interrupted first: worker/rank.py). It is collective, as a
save is: the ranks agree on the newest step they all hold and write it only where it is newer
than the disk's newest checkpoint, committed as every save is (LATEST names it, retention
applies). The host agent bounds the time it may take (host/persisting.py) and frees the store
after it either way.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol


class SnapshotWriter(Protocol):
    """What persisting uses of a Checkpointer (checkpoint/manager.py)."""

    @property
    def directory(self) -> object: ...

    def wait(self) -> None: ...

    def snapshot_newer_than_disk(self) -> int | None: ...

    def save_memory_snapshot(self) -> int: ...


def persist_newest_snapshot(checkpointer: SnapshotWriter) -> str:
    """Collective: write the newest snapshot every rank holds, where it is newer than the disk's
    newest checkpoint, to the checkpointer's directory. Returns what was done, as a line."""
    started = time.monotonic()
    try:
        checkpointer.wait()  # a save in flight commits first
    except Exception as error:  # reported (or not) by the cell that started it; the snapshot is another matter
        print(f"the save in flight failed: {error}", file=sys.stderr, flush=True)
    if checkpointer.snapshot_newer_than_disk() is None:
        return f"no snapshot in host memory is newer than the newest checkpoint in {checkpointer.directory}"
    step = checkpointer.save_memory_snapshot()
    return (f"wrote step {step} from host memory to {checkpointer.directory} as a checkpoint "
            f"in {time.monotonic() - started:.1f} s")


def persist_at_kernel_exit(rank: int) -> None:
    """On a rank whose kernel is gone: persist the tracked Checkpointer's newest snapshot (see the
    module's docstring), saying in the rank's log what was done or why it failed."""
    from fsdp2nb import progress
    from fsdp2nb.checkpoint.manager import Checkpointer
    from fsdp2nb.checkpoint.tracking import current_checkpointer

    checkpointer = current_checkpointer()
    if not isinstance(checkpointer, Checkpointer):
        return  # nothing tracked (or not a Checkpointer): nothing in host memory to write
    progress.install(None)  # the save's progress has no kernel to go to
    try:
        done = persist_newest_snapshot(checkpointer)
    except Exception as error:
        print(f"rank {rank}: the kernel is gone; writing its newest snapshot to disk failed: {error}",
              file=sys.stderr, flush=True)
        return
    if rank == 0:
        print(f"rank 0: the kernel is gone; {done}", file=sys.stderr, flush=True)
