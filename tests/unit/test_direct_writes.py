"""Files written past the page cache hold exactly the bytes written, whatever the write sizes."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from fsdp2nb.checkpoint.direct_writes import _BUFFER_BYTES, DirectFileSystem, DirectWriteStream
from fsdp2nb.checkpoint.layout import CHECKSUM_SUFFIX

SIZES = [0, 1, 4095, 4096, 4097, _BUFFER_BYTES - 3, _BUFFER_BYTES, 3 * _BUFFER_BYTES + 17]


@pytest.mark.parametrize("size", SIZES)
def test_stream_writes_exact_bytes(tmp_path, size):
    payload = os.urandom(size)
    path = tmp_path / "f.bin"
    stream = DirectWriteStream(path)
    # Uneven pieces, as torch.save's zip writer hands them over, one a memoryview of floats.
    pieces = [payload[:1], payload[1:5000], memoryview(payload[5000:])]
    for piece in pieces:
        stream.write(piece)
    assert stream.tell() == size
    stream.close()
    stream.close()  # twice is harmless
    assert path.read_bytes() == payload


@pytest.mark.parametrize("size", [0, 4097, _BUFFER_BYTES, 3 * _BUFFER_BYTES + 17])
def test_checksum_beside_the_file_is_the_crc32_of_its_bytes(tmp_path, size):
    payload = os.urandom(size)
    path = tmp_path / "__0_0.distcp"
    stream = DirectWriteStream(path, checksum=True)
    for start in range(0, size, 1_000_003):  # pieces that straddle the buffers handed to the disk
        stream.write(payload[start:start + 1_000_003])
    stream.close()
    assert (tmp_path / f"{path.name}{CHECKSUM_SUFFIX}").read_text() == f"{zlib.crc32(payload):08x}"


def test_non_byte_memoryviews_are_written_as_their_bytes(tmp_path):
    values = torch.arange(1000, dtype=torch.float32)
    path = tmp_path / "f.bin"
    stream = DirectWriteStream(path)
    stream.write(memoryview(values.numpy()))
    stream.close()
    assert path.read_bytes() == values.numpy().tobytes()


def test_dcp_files_load_with_the_stock_reader(tmp_path):
    state = {"w": torch.randn(300, 7), "b": torch.arange(5), "step": 3}
    writer = FileSystemWriter(tmp_path, sync_files=True)
    writer.fs = DirectFileSystem()
    dcp.save(state, storage_writer=writer, no_dist=True)
    loaded = {"w": torch.zeros(300, 7), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"]) and loaded["step"] == 3
