"""Row blocks read past the page cache equal what safetensors slicing gives, in every dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fsdp2nb.engine.direct_reads import RowBlock, RowBlockReader, read_header

TENSORS = {
    "f32": torch.randn(37, 129),
    "bf16": torch.randn(11, 5, 7).to(torch.bfloat16),
    "i64": torch.arange(3 * 1001).reshape(3, 1001),
    "u8": torch.randint(0, 255, (4099,), dtype=torch.uint8),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("direct") / "model.safetensors")
    save_file(TENSORS, path)
    return path


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("chunk_bytes", [4096, 32 * 1024 * 1024])
def test_row_blocks_match_safetensors_slices(checkpoint: str, direct: bool, chunk_bytes: int) -> None:
    stored = read_header(checkpoint)
    reader = RowBlockReader(checkpoint, direct=direct, chunk_bytes=chunk_bytes)
    if direct and not reader.direct:
        reader.close()
        pytest.skip("this file system does not support O_DIRECT")
    try:
        with safe_open(checkpoint, framework="pt") as handle:
            for key, tensor in TENSORS.items():
                for rows in (slice(0, tensor.shape[0]), slice(1, tensor.shape[0] - 1), slice(2, 3)):
                    out = torch.empty((rows.stop - rows.start, *tensor.shape[1:]), dtype=tensor.dtype)
                    reader.copy_blocks([RowBlock(stored[key], rows, out)])
                    assert torch.equal(out, handle.get_slice(key)[rows]), (key, rows)
    finally:
        reader.close()


def test_blocks_are_cast_into_the_destination_dtype(checkpoint: str) -> None:
    reader = RowBlockReader(checkpoint, direct=True)
    try:
        out = torch.empty(5, 129, dtype=torch.bfloat16)
        reader.copy_blocks([RowBlock(read_header(checkpoint)["f32"], slice(3, 8), out)])
    finally:
        reader.close()
    assert torch.equal(out, TENSORS["f32"][3:8].to(torch.bfloat16))


def test_chunk_size_must_be_block_aligned(checkpoint: str) -> None:
    with pytest.raises(ValueError, match="chunk_bytes=1000"):
        RowBlockReader(checkpoint, chunk_bytes=1000)


def test_cached_fraction_sees_the_page_cache_without_filling_it(tmp_path):
    import os

    from fsdp2nb.engine.direct_reads import cached_fraction

    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 * 1024 * 1024))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.fsync(fd)
        for _ in range(20):  # pages in another CPU's LRU batch are skipped: ask again
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if cached_fraction(fd, size) < 0.1:
                break
        else:
            pytest.skip("the page cache would not let go of the file")
        assert cached_fraction(fd, size) < 0.1  # asking twice did not read the file in
        os.pread(fd, size, 0)
        assert cached_fraction(fd, size) > 0.9
    finally:
        os.close(fd)


def test_a_checkpoint_file_serves_row_column_and_scalar_blocks(tmp_path) -> None:
    from fsdp2nb.engine.hf_files import Block, find_checkpoint_files, open_reader

    tensors = {"matrix": torch.randn(6, 10), "scalar": torch.tensor(3.5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = find_checkpoint_files(tmp_path)
    assert set(files.key_to_file) == set(tensors) and "model.safetensors" in files.headers
    rows, columns, scalar = torch.empty(2, 10, dtype=torch.bfloat16), torch.empty(6, 3), torch.empty(())
    with open_reader(files, "model.safetensors") as reader:
        reader.copy_blocks([
            Block("matrix", (slice(2, 4), slice(0, 10)), rows),  # whole rows: read directly
            Block("matrix", (slice(0, 6), slice(4, 7)), columns),  # a column block: sliced through mmap
            Block("scalar", (), scalar),
        ])
    assert torch.equal(rows, tensors["matrix"][2:4].to(torch.bfloat16))
    assert torch.equal(columns, tensors["matrix"][:, 4:7])
    assert torch.equal(scalar, tensors["scalar"])
