"""What reading and writing past the page cache (O_DIRECT) needs, shared by the engine's checkpoint
reads and the checkpointer's writes: the alignment, opening with a fallback for file systems that
refuse direct I/O (tmpfs), and page-aligned buffers reused between files."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

BLOCK = 4096
"""Offsets, lengths and buffer addresses are multiples of this: it covers every logical block size."""


def round_up(num_bytes: int) -> int:
    return -(-num_bytes // BLOCK) * BLOCK


def open_direct(path: str | os.PathLike, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """(a descriptor opened with `flags`, whether it is O_DIRECT); plain where the file system refuses."""
    fd = os.open(path, flags, mode)
    try:
        return fd, set_direct(fd)
    except BaseException:
        os.close(fd)
        raise


def set_direct(fd: int) -> bool:
    """Turn on O_DIRECT for an open descriptor; False where the file system refuses it (tmpfs)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return False
    return True


class BufferPool:
    """Page-aligned buffers (anonymous maps are) kept for reuse: faulting in fresh pages for every
    file costs more than reusing them. Holds at most `keep` spares; thread-safe."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._spares: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            for i, buffer in enumerate(self._spares):
                if len(buffer) == size:
                    return self._spares.pop(i)
        return mmap.mmap(-1, size)

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._spares) < self._keep:
                self._spares.append(buffer)
                return
        buffer.close()

    def clear(self) -> None:
        """Give the spares back to the system."""
        with self._lock:
            spares, self._spares = self._spares, []
        for buffer in spares:
            buffer.close()
