"""Find the tensors of a Hugging Face checkpoint directory and read just the slices a rank needs."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch

logger = logging.getLogger(__name__)

FileFormat = Literal["safetensors", "bin"]

# (index file, single file, format), in the order transformers prefers them.
_LAYOUTS: tuple[tuple[str, str, FileFormat], ...] = (
    ("model.safetensors.index.json", "model.safetensors", "safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", "bin"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointFiles:
    """Where each checkpoint key is stored."""

    directory: Path
    """The checkpoint directory."""
    file_format: FileFormat
    """"safetensors" (sliceable on disk) or "bin" (pickled, read whole through mmap)."""
    key_to_file: dict[str, str] = field(default_factory=dict)
    """Checkpoint key -> file name inside `directory`."""


def find_checkpoint_files(directory: str | os.PathLike) -> CheckpointFiles:
    """Index the weights of `directory`: a single file, or several listed by an index JSON."""
    directory = Path(directory)
    for index_name, single_name, file_format in _LAYOUTS:
        if (directory / index_name).is_file():
            weight_map = json.loads((directory / index_name).read_text())["weight_map"]
            return CheckpointFiles(directory=directory, file_format=file_format, key_to_file=dict(weight_map))
        if (directory / single_name).is_file():
            keys = _keys_of(directory / single_name, file_format)
            return CheckpointFiles(
                directory=directory, file_format=file_format, key_to_file=dict.fromkeys(keys, single_name)
            )
    raise FileNotFoundError(
        f"no model.safetensors[.index.json] or pytorch_model.bin[.index.json] in {directory}"
    )


def _keys_of(path: Path, file_format: FileFormat) -> list[str]:
    if file_format == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True).keys())


class SliceReader(Protocol):
    """Reads `key[index]` from one open checkpoint file."""

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor: ...


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _SafetensorsReader:
    """Reads a rank's block of a safetensors tensor, whole rows with one pread.

    A block made of whole rows (FSDP's Shard(0)) is one contiguous byte range of the file. Reading
    it with pread, read-ahead off, moves exactly those bytes; slicing through mmap faults pages in
    4 KiB at a time plus the kernel's read-ahead, about 4x slower on a cold page cache for a
    0.5B model's quarter (measured: 0.9 s against 3.9 s). Other blocks go through safetensors.
    """

    def __init__(self, path: Path, handle) -> None:
        self._handle = handle
        self._data_start, self._entries = _safetensors_header(path)
        self._fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        entry = self._entries[key]
        dtype, shape = _SAFETENSORS_DTYPES.get(entry["dtype"]), tuple(entry["shape"])
        if dtype is None or not shape or not _whole_rows(index, shape):
            # a 0-d tensor has nothing to slice; get_slice reads only the requested bytes
            return self._handle.get_slice(key)[index] if index else self._handle.get_tensor(key)
        first, last = index[0].start, index[0].stop
        block = torch.empty((last - first, *shape[1:]), dtype=dtype)
        row_bytes = block[0].numel() * block.element_size() if len(block) else 0
        _pread_exactly(self._fd, block.view(-1).view(torch.uint8).numpy(),
                       self._data_start + entry["data_offsets"][0] + first * row_bytes)
        return block

    def close(self) -> None:
        os.close(self._fd)


def _safetensors_header(path: Path) -> tuple[int, dict[str, dict]]:
    """(where the data starts, the tensor table): the format is an 8-byte little-endian header
    size, a JSON header of dtype, shape and data offsets per key, then the data."""
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(header_size))
    entries.pop("__metadata__", None)
    return 8 + header_size, entries


def _whole_rows(index: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether `index` keeps every dimension but the first whole (a contiguous byte range)."""
    return index[0].step in (None, 1) and all(
        (part.start, part.stop, part.step) == (0, size, None) for part, size in zip(index[1:], shape[1:], strict=True)
    )


def _pread_exactly(fd: int, buffer, offset: int) -> None:
    view = memoryview(buffer).cast("B")
    while view:
        num_read = os.preadv(fd, [view], offset)
        if num_read == 0:
            raise EOFError(f"checkpoint file ended early at byte {offset}")
        view, offset = view[num_read:], offset + num_read


class _StateDictReader:
    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._state_dict = state_dict

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._state_dict[key][index]


@contextmanager
def open_reader(files: CheckpointFiles, file_name: str) -> Iterator[SliceReader]:
    """Open one checkpoint file for slicing; .bin files are pickles and are mapped whole (mmap)."""
    path = files.directory / file_name
    if files.file_format == "safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as handle:
            reader = _SafetensorsReader(path, handle)
            try:
                yield reader
            finally:
                reader.close()
        return
    state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    try:
        yield _StateDictReader(state_dict)
    finally:
        del state_dict


def tensor_shape(reader: SliceReader, key: str) -> tuple[int, ...]:
    """The full shape of `key` without reading its data."""
    if isinstance(reader, _SafetensorsReader):
        return tuple(reader._handle.get_slice(key).get_shape())
    assert isinstance(reader, _StateDictReader)
    return tuple(reader._state_dict[key].shape)
