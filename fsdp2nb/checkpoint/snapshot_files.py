"""The files of a snapshot store as a rank maps them: a slot's bytes, and the board of steps.

Both live on a tmpfs, so their pages are host memory that outlives the rank; the space is
reserved with `posix_fallocate` when a file is made, so a full tmpfs fails then, not as a SIGBUS
in the middle of a copy. Files are 0600, opened without following links; a new one is made under
a random name opened exclusively, then renamed into place.
"""

from __future__ import annotations

import mmap
import os
import secrets
import stat
from pathlib import Path

import torch

from fsdp2nb.checkpoint.snapshot_layout import Entry
from fsdp2nb.errors import MemorySnapshotRefused, UnsafeDirectory

_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _checked(descriptor: int, path: Path) -> int:
    """`descriptor`, if it is a regular file of this user's; else closed and refused."""
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(descriptor)
        raise UnsafeDirectory(f"the snapshot store's {path} is not a file of this user's; nothing was written: "
                              "remove it and run the cell again")
    return descriptor


def _fresh_file(path: Path, num_bytes: int) -> Path:
    """A new 0600 file of `num_bytes` beside `path`, under a random name opened exclusively."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    descriptor = os.open(temporary, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if num_bytes:
            os.posix_fallocate(descriptor, 0, num_bytes)  # a full tmpfs fails here, not as SIGBUS mid-copy
    except BaseException:
        os.unlink(temporary)
        raise
    finally:
        os.close(descriptor)
    return temporary


def _mapped(descriptor: int, path: Path, num_bytes: int, *, grow: bool = False) -> mmap.mmap | None:
    try:
        if grow and os.fstat(descriptor).st_size < num_bytes:
            os.posix_fallocate(descriptor, 0, num_bytes)
        if os.fstat(descriptor).st_size < num_bytes:
            raise MemorySnapshotRefused(f"{path} holds fewer than the {num_bytes} bytes its manifest gives")
        return mmap.mmap(descriptor, num_bytes) if num_bytes else None
    finally:
        os.close(descriptor)


def new_mapped_file(path: Path, num_bytes: int) -> mmap.mmap | None:
    """A fresh file of `num_bytes` at `path` (replacing what was there), mapped shared; None for no bytes."""
    temporary = _fresh_file(path, num_bytes)
    os.replace(temporary, path)
    return _mapped(_checked(os.open(path, _OPEN_FLAGS), path), path, num_bytes)


def existing_mapped_file(path: Path, num_bytes: int) -> mmap.mmap | None:
    """The file at `path` (a link refused), mapped shared; None for no bytes."""
    return _mapped(_checked(os.open(path, _OPEN_FLAGS), path), path, num_bytes)


def shared_mapped_file(path: Path, num_bytes: int) -> mmap.mmap:
    """The file at `path` that the ranks of a host share, made by whichever comes first."""
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        temporary = _fresh_file(path, num_bytes)
        try:
            os.link(temporary, path)  # fails if another rank made it meanwhile: theirs is taken
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
        descriptor = os.open(path, _OPEN_FLAGS)
    mapped = _mapped(_checked(descriptor, path), path, num_bytes, grow=True)  # a larger world than the last
    assert mapped is not None, "a shared file has bytes"
    return mapped


class Slot:
    """One slot file mapped into this process."""

    def __init__(self, path: Path, num_bytes: int, *, fresh: bool) -> None:
        """`fresh`: a new file replaces what `path` held; else the file there is mapped."""
        self.path, self.num_bytes = path, num_bytes
        self._map = (new_mapped_file if fresh else existing_mapped_file)(path, num_bytes)
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
    (a new file is zeros: 0 means none, or being written; -(step + 1): that step's copy failed)."""

    def __init__(self, path: Path, world_size: int) -> None:
        self._map = shared_mapped_file(path, 16 * world_size)
        self._steps = memoryview(self._map).cast("q")

    def get(self, rank: int, slot: int) -> int:
        """The step, or -1."""
        return self._steps[2 * rank + slot] - 1

    def newest(self, rank: int) -> int:
        return max(self.get(rank, 0), self.get(rank, 1))

    def set(self, rank: int, slot: int, step: int | None) -> None:
        self._steps[2 * rank + slot] = 0 if step is None else step + 1

    def mark_failed(self, rank: int, slot: int, step: int) -> None:
        """The copy of `step` into the slot failed: neither whole nor still coming (negative)."""
        self._steps[2 * rank + slot] = -(step + 1)

    def clear_failed(self, rank: int) -> None:
        """Every rank has heard of the rank's failed copy: mark its slot as being written again."""
        for index in (2 * rank, 2 * rank + 1):
            if self._steps[index] < 0:
                self._steps[index] = 0

    def failed_step(self, rank: int) -> int:
        """The step of the rank's last failed copy still marked, or -1."""
        return max(-value - 1 if value < 0 else -1 for value in self._steps[2 * rank:2 * rank + 2])

    def close(self) -> None:
        self._steps.release()
        self._map.close()


def tmpfs_free(folder: Path) -> int:
    try:
        info = os.statvfs(folder)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize
