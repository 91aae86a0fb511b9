"""Write checkpoint files past the page cache (O_DIRECT), for DCP's FileSystemWriter.

A buffered write costs the kernel a page allocation and a copy per 4 KiB, then write-back and,
when the file is deleted by retention, freeing it all again. During an asynchronous save that
CPU time is taken from training. Here DCP's bytes are gathered in a reused page-aligned buffer
and written from it by DMA; the file keeps exactly DCP's format, so any DCP reader loads it.

A file system that refuses O_DIRECT (tmpfs) gets the same stream over a buffered descriptor.
Each shard's CRC32 is computed from the buffers on their way to the disk, on the thread that
writes them, and left beside the shard (`<shard>.crc32`) for the commit to record.
`ShardWriter` is the FileSystemWriter the Checkpointer hands DCP: it writes through this file system.
"""

from __future__ import annotations

import io
import mmap
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp2nb import progress
from fsdp2nb.checkpoint.layout import CHECKSUM_SUFFIX, SHARD_SUFFIX
from fsdp2nb.direct_io import BufferPool, open_direct, round_up

_WRITER_NICENESS = 19
_BUFFER_BYTES = 8 * 1024 * 1024  # a multiple of BLOCK

_buffers = BufferPool(keep=2)  # one stream's pair: DCP writes a rank's files one after another


class DirectFileSystem(FileSystem):
    """DCP's local file system, with files opened for writing as `DirectWriteStream`s."""

    def __init__(self, task: progress.AnyTask = progress.SILENT, checksums: bool = True) -> None:
        super().__init__()
        self._task = task
        self._checksums = checksums

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        summed = self._checksums and str(path).endswith(SHARD_SUFFIX)
        stream = DirectWriteStream(Path(path), self._task, checksum=summed)
        try:
            yield stream
        finally:
            stream.close()


class DirectWriteStream(io.RawIOBase):
    """A write-only file stream; its bytes are durable (written and fsynced) once closed.

    Two buffers: while one is written to disk by a helper thread, the caller fills the other,
    so serializing the next bytes overlaps the disk's work on the last ones.
    """

    def __init__(self, path: Path, task: progress.AnyTask = progress.SILENT, checksum: bool = False) -> None:
        super().__init__()
        self._path = path
        self._task = task  # advanced by each buffer handed to the disk: 8 MiB, not each small write
        self._crc: int | None = 0 if checksum else None  # running CRC32 of the bytes handed to the disk
        self._fd, self.direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._buffer = _buffers.take(_BUFFER_BYTES)
        self._filled = 0  # bytes waiting in the buffer
        self._written = 0  # file offset where the buffer starts
        self._io = ThreadPoolExecutor(1, thread_name_prefix="fsdp2nb-direct-write")
        self._in_flight: tuple[Future, mmap.mmap] | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written + self._filled

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:  # any bytes-like object
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            take = min(len(view) - done, _BUFFER_BYTES - self._filled)
            self._buffer[self._filled:self._filled + take] = view[done:done + take]
            self._filled += take
            done += take
            if self._filled == _BUFFER_BYTES:
                self._write_full_buffer()
        return done

    def _write_full_buffer(self) -> None:
        """Hand the full buffer to the helper thread and go on filling the other one."""
        spare = self._wait_in_flight() or _buffers.take(_BUFFER_BYTES)
        future = self._io.submit(self._sum_and_write, self._buffer, _BUFFER_BYTES, self._written)
        self._in_flight = (future, self._buffer)
        self._buffer = spare
        self._written += _BUFFER_BYTES
        self._filled = 0
        self._task.advance(_BUFFER_BYTES)

    def _wait_in_flight(self) -> mmap.mmap | None:
        """Wait for the buffer being written (raising its error); return it for reuse."""
        if self._in_flight is None:
            return None
        future, buffer = self._in_flight
        self._in_flight = None
        try:
            future.result()
        except BaseException:
            _buffers.give(buffer)
            raise
        return buffer

    def close(self) -> None:
        """Write what is buffered, trim the padding of the last block, fsync; safe to call twice."""
        if self.closed:
            return
        try:
            spare = self._wait_in_flight()
            if spare is not None:
                _buffers.give(spare)
            tail = self._filled
            if tail:
                padded = round_up(tail) if self.direct else tail
                self._buffer[tail:padded] = bytes(padded - tail)
                self._sum(self._buffer, tail)
                _pwrite_all(self._fd, self._buffer, padded, self._written)
                if padded != tail:
                    os.ftruncate(self._fd, self._written + tail)
                self._task.advance(tail)
            os.fsync(self._fd)
            if self._crc is not None:  # the commit reads it into the metadata (made durable) and removes it
                checksum_path = self._path.with_name(self._path.name + CHECKSUM_SUFFIX)
                checksum_path.write_text(f"{self._crc:08x}")
        finally:
            self._io.shutdown(wait=True)
            if self._in_flight is not None:  # close() after a failed write
                _buffers.give(self._in_flight[1])
            os.close(self._fd)
            _buffers.give(self._buffer)
            super().close()


    def _sum_and_write(self, buffer: mmap.mmap, length: int, offset: int) -> None:
        """On the helper thread, in file order: one buffer at a time, so the running CRC32 stays in order."""
        self._sum(buffer, length)
        _pwrite_all(self._fd, buffer, length, offset)

    def _sum(self, buffer: mmap.mmap, length: int) -> None:
        if self._crc is None:
            return
        with memoryview(buffer)[:length] as view:
            self._crc = zlib.crc32(view, self._crc)  # releases the GIL on large buffers


def _pwrite_all(fd: int, buffer: mmap.mmap, length: int, offset: int) -> None:
    view = memoryview(buffer)[:length]
    try:
        done = 0
        while done < length:
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        view.release()


class ShardWriter(FileSystemWriter):
    """FileSystemWriter that writes past the page cache; in DCP's writer process it also skips
    zip CRC32s and runs at the lowest CPU priority.

    Direct writes (DirectFileSystem above) leave the CPU to training. torch.load never checks the
    CRC32s, and computing them is a large part of the CPU time of serializing a shard; the switch is
    process-wide, so it is only thrown in the writer process, which does nothing else. Niceness
    is per process too: a thread of the training process cannot be deprioritised without
    stalling training on the GIL it holds.
    """

    def __init__(self, path: Path, task: progress.AnyTask = progress.SILENT, checksums: bool = True) -> None:
        # DirectWriteStream fsyncs every file as it closes it; DCP's own fsync would come before
        # the stream's last buffer is written, so it is left off rather than done twice.
        super().__init__(path, sync_files=False)
        self.fs = DirectFileSystem(task, checksums)
        self._owner_pid = os.getpid()

    def write_data(self, plan, planner):  # signature of the base class
        if os.getpid() != self._owner_pid:
            torch.serialization.set_crc32_options(False)
            # Background work: training keeps the cores and the writer takes what is left.
            os.setpriority(os.PRIO_PROCESS, 0, _WRITER_NICENESS)
        return super().write_data(plan, planner)
