"""Read a rank's row block of a safetensors tensor straight from disk, past the page cache.

FSDP2 shards dim 0, so a rank's block of a row-major tensor is one contiguous byte range of the
file. Reading it through the page cache (mmap slicing or plain pread) costs the kernel a page
allocation and copy per 4 KiB, which on a small VM cuts the disk's throughput (docs/benchmarks.md
has the figures). Direct reads go from the disk into reused,
page-aligned bounce buffers; each chunk is then cast into the rank's shard.

When most of a file is already in the page cache (asked of mincore), buffered reads are faster
and are used instead; a file system that refuses O_DIRECT (tmpfs) also gets them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import math
import mmap
import os
import queue
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fsdp2nb.direct_io import BLOCK, BufferPool, round_up, set_direct

_CHUNK_BYTES = 32 * 1024 * 1024  # bounce buffer: a multiple of BLOCK and of every element size
_THREADS = 2

_buffers = BufferPool(keep=_THREADS)  # reused across the files of one load (sharded checkpoints)

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    dtype: torch.dtype | None
    """None for a stored dtype torch has no match for (such a tensor is not read here)."""
    shape: tuple[int, ...]
    itemsize: int
    """Bytes per element as stored."""
    start: int
    """Absolute file offset of the first byte."""

    def row_range(self, rows: slice) -> tuple[int, int]:
        """(first byte, end byte) of rows `rows.start:rows.stop`: contiguous in row-major order."""
        row_bytes = self.itemsize
        for size in self.shape[1:]:
            row_bytes *= size
        return self.start + rows.start * row_bytes, self.start + rows.stop * row_bytes


def read_header(path: str) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file, by key."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        dtype = _DTYPES.get(entry["dtype"])
        numel = math.prod(shape)
        itemsize = (end - start) // numel if numel else (dtype.itemsize if dtype is not None else 0)
        tensors[key] = StoredTensor(dtype, shape, itemsize, data_start + start)
    return tensors


@dataclass(frozen=True, slots=True)
class RowBlock:
    """Rows `rows` of a stored tensor, to be cast into `out` (contiguous, shaped as the block)."""

    stored: StoredTensor
    rows: slice
    out: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Chunk:
    offset: int
    length: int
    dtype: torch.dtype
    out: torch.Tensor  # a flat slice of a RowBlock's out


class RowBlockReader:
    """Copies row blocks of one file's tensors into destination tensors; close() when done.

    Two threads each read a chunk into their own bounce buffer and cast it into place, so one
    waits on the disk while the other copies (preadv and torch's copy both release the GIL).
    `direct`: None decides by probing the page cache; True/False force a way (tests).
    """

    def __init__(self, path: str, *, direct: bool | None = None, chunk_bytes: int = _CHUNK_BYTES) -> None:
        if chunk_bytes <= 0 or chunk_bytes % BLOCK:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {BLOCK}")  # internal: the engine's own reading size, not a user's
        self._chunk_bytes = chunk_bytes
        self._fd, self.direct = _open_for_reading(path, direct)
        self._free_buffers: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        for _ in range(_THREADS):
            self._free_buffers.put(_buffers.take(chunk_bytes + BLOCK))

    def copy_blocks(self, blocks: list[RowBlock]) -> None:
        chunks = [chunk for block in blocks for chunk in self._chunks(block)]
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="fsdp2nb-read") as pool:
            for _ in pool.map(self._copy_chunk, chunks):
                pass  # re-raises the first failure

    def _chunks(self, block: RowBlock) -> list[_Chunk]:
        start, end = block.stored.row_range(block.rows)
        flat_out = block.out.view(-1)
        itemsize = block.stored.itemsize
        chunks = []
        for offset in range(start, end, self._chunk_bytes):
            length = min(self._chunk_bytes, end - offset)
            first = (offset - start) // itemsize
            chunks.append(_Chunk(offset, length, block.stored.dtype, flat_out[first:first + length // itemsize]))
        return chunks

    def _copy_chunk(self, chunk: _Chunk) -> None:
        buffer = self._free_buffers.get()
        try:
            view = self._read(buffer, chunk.offset, chunk.length)
            chunk.out.copy_(torch.frombuffer(view, dtype=chunk.dtype))
            del view  # a live export would keep the buffer from being closed
        finally:
            self._free_buffers.put(buffer)

    def _read(self, buffer: mmap.mmap, offset: int, length: int) -> memoryview:
        """`length` bytes at `offset`, as a view into `buffer`."""
        if not self.direct:
            got = os.preadv(self._fd, [memoryview(buffer)[:length]], offset)
            return _checked(memoryview(buffer)[:got], length, offset)
        aligned = offset - offset % BLOCK
        span = round_up(offset + length - aligned)
        got = os.preadv(self._fd, [memoryview(buffer)[:span]], aligned)
        skip = offset - aligned
        return _checked(memoryview(buffer)[skip:min(got, skip + length)], length, offset)

    def close(self) -> None:
        os.close(self._fd)
        while not self._free_buffers.empty():
            _buffers.give(self._free_buffers.get())


def _open_for_reading(path: str, direct: bool | None) -> tuple[int, bool]:
    """(descriptor, whether it reads past the page cache): direct unless most of the file is cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if direct is False or (direct is None and cached_fraction(fd, os.fstat(fd).st_size) >= 0.5):
            return fd, False
        return fd, set_direct(fd)
    except BaseException:
        os.close(fd)
        raise


def release_spare_buffers() -> None:
    """Give the reused buffers back to the system (at the end of a load)."""
    _buffers.clear()


def _checked(view: memoryview, length: int, offset: int) -> memoryview:
    if len(view) != length:
        raise OSError(errno.EIO, f"short read: {len(view)} of {length} bytes at offset {offset}")  # internal: the disk returned less than the file holds, not bad input
    return view


def cached_fraction(fd: int, size: int) -> float:
    """The fraction of the file's pages in the page cache, asked of mincore(2) on a mapping.

    A read probe would not do: even with RWF_NOWAIT a miss starts read-ahead, so the probes of
    the first rank would make the file look cached to the ranks after it. 0.0 when unknown.
    """
    if size == 0:
        return 0.0
    libc = _libc()
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return 0.0
    try:
        pages = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
        if libc.mincore(address, size, pages) != 0:
            return 0.0
    finally:
        libc.munmap(address, size)
    return (len(pages) - bytes(pages).count(0)) / len(pages)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc
