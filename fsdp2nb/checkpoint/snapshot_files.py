"""The files of a snapshot store as a rank maps them: a slot's bytes, and the board of steps.

Both live on a tmpfs, so their pages are host memory that outlives the rank; the space is
reserved with `posix_fallocate` when a file is made, so a full tmpfs fails then, not as a SIGBUS
in the middle of a copy.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from fsdp2nb.checkpoint.snapshot_layout import Entry


def mapped_file(path: Path, num_bytes: int) -> mmap.mmap | None:
    """`path` (made if missing, 0600) grown to `num_bytes` and mapped shared; None for no bytes."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(descriptor).st_size < num_bytes:
            os.posix_fallocate(descriptor, 0, num_bytes)  # a full tmpfs fails here, not as SIGBUS mid-copy
        return mmap.mmap(descriptor, num_bytes) if num_bytes else None
    finally:
        os.close(descriptor)


class Slot:
    """One slot file mapped into this process."""

    def __init__(self, path: Path, num_bytes: int) -> None:
        self.path, self.num_bytes = path, num_bytes
        self._map = mapped_file(path, num_bytes)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else \
            torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self._views: tuple[list[Entry], list[torch.Tensor]] | None = None

    def views(self, layout: list[Entry]) -> list[torch.Tensor]:
        """A view of the slot per entry of `layout`, made once per layout (a copy reuses them)."""
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, [self.view(entry) for entry in layout])
        return self._views[1]

    def view(self, entry: Entry) -> torch.Tensor:
        raw = self.bytes[entry.offset:entry.offset + entry.num_bytes]
        return raw.view(getattr(torch, entry.dtype)).view(entry.shape)

    def pin(self) -> None:
        """Page-lock the slot for the GPU's copies (cudaHostRegister), once."""
        if not self.pinned and self.num_bytes:  # where it fails, the copies are synchronous instead
            error = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.num_bytes, 0)
            self.pinned = int(error) == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self._views = None
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:  # a view handed out is still alive: the mapping goes with it
            pass


class Board:
    """Per rank and slot, the step the slot holds whole, in a shared file: an int64 each, step + 1
    (a new file is zeros: 0 means none, or being written)."""

    def __init__(self, path: Path, world_size: int) -> None:
        mapped = mapped_file(path, 16 * world_size)
        assert mapped is not None, "a world has a rank"
        self._map = mapped
        self._steps = memoryview(self._map).cast("q")

    def get(self, rank: int, slot: int) -> int:
        """The step, or -1."""
        return self._steps[2 * rank + slot] - 1

    def newest(self, rank: int) -> int:
        return max(self.get(rank, 0), self.get(rank, 1))

    def set(self, rank: int, slot: int, step: int | None) -> None:
        self._steps[2 * rank + slot] = 0 if step is None else step + 1

    def close(self) -> None:
        self._steps.release()
        self._map.close()


def tmpfs_free(folder: Path) -> int:
    try:
        info = os.statvfs(folder)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize
