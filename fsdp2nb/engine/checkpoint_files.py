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


class _SafetensorsReader:
    def __init__(self, handle) -> None:
        self._handle = handle

    def read(self, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        # get_slice reads only the requested byte ranges; a 0-d tensor has nothing to slice.
        view = self._handle.get_slice(key)
        return view[index] if index else self._handle.get_tensor(key)


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
            yield _SafetensorsReader(handle)
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
