"""Find the tensors of a Hugging Face checkpoint directory and read just the slices a rank needs."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch

from fsdp2nb.engine.direct_reads import RowBlock, RowBlockReader, StoredTensor, read_header
from fsdp2nb.errors import ModelNotFound, UsageMistake

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
    headers: dict[str, dict[str, StoredTensor]] = field(default_factory=dict, repr=False, compare=False)
    """Parsed safetensors headers by file name, kept as they are read: each is read once."""

    def header(self, file_name: str) -> dict[str, StoredTensor]:
        header = self.headers.get(file_name)
        if header is None:
            header = self.headers[file_name] = read_header(str(self.directory / file_name))
        return header


def find_checkpoint_files(directory: str | os.PathLike) -> CheckpointFiles:
    """Index the weights of `directory`: a single file, or several listed by an index JSON."""
    directory = Path(directory)
    refuse_quantized(directory)
    for index_name, single_name, file_format in _LAYOUTS:
        if (directory / index_name).is_file():
            weight_map = json.loads((directory / index_name).read_text())["weight_map"]
            return CheckpointFiles(directory=directory, file_format=file_format, key_to_file=dict(weight_map))
        if (directory / single_name).is_file():
            files = CheckpointFiles(directory=directory, file_format=file_format)
            keys = files.header(single_name) if file_format == "safetensors" else _keys_of_bin(directory / single_name)
            files.key_to_file.update(dict.fromkeys(keys, single_name))
            return files
    raise ModelNotFound(
        f"no model.safetensors[.index.json] or pytorch_model.bin[.index.json] in {directory}"
    )


def refuse_quantized(directory: Path) -> None:
    """A quantized checkpoint (FP8 with scales, GPTQ, ...) would load as its raw integers or
    scaled floats: refuse it, since the engine trains unquantized weights."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        return
    quantization = json.loads(config_path.read_text()).get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
        raise UsageMistake(f"{directory} holds a quantized checkpoint (quant_method={method!r}); the engine trains "
                           "unquantized weights: load the bf16/fp16/fp32 release of this model")


def _keys_of_bin(path: Path) -> list[str]:
    return list(_load_bin(path).keys())


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A .bin state dict, memory-mapped; files in torch's pre-1.6 format cannot be, and are read whole."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        logger.info("%s is in torch's legacy format: reading it whole", path.name)
        return torch.load(path, map_location="cpu", weights_only=True)


class SliceReader(Protocol):
    """One open checkpoint file: shapes and stored element sizes, and blocks copied out of it."""

    def shape(self, key: str) -> tuple[int, ...]: ...

    def itemsize(self, key: str) -> int: ...

    @property
    def direct_io(self) -> bool:
        """Whether blocks are read past the page cache."""

    def copy_blocks(self, blocks: list[Block]) -> None:
        """out[...] = key[index] for each block, cast to out's dtype."""


@dataclass(frozen=True, slots=True)
class Block:
    """`key[index]` of the checkpoint, to be copied into `out` (shaped as the block)."""

    key: str
    index: tuple[slice, ...]
    out: torch.Tensor


class _SafetensorsReader:
    """Row blocks (what FSDP2's dim-0 shards are) by direct reads; other blocks by mmap slicing.

    Each way is opened only when a block needs it, so a file read only in row blocks is mapped
    by no one and its header is parsed once (by `CheckpointFiles.header`).
    """

    def __init__(self, path: Path, stored: dict[str, StoredTensor]) -> None:
        self._path = path
        self._stored = stored
        self._rows: RowBlockReader | None = None
        self._mapped = None  # a safetensors safe_open handle
        self._closing = ExitStack()

    @property
    def direct_io(self) -> bool:
        return self._rows is not None and self._rows.direct

    def shape(self, key: str) -> tuple[int, ...]:
        return self._stored[key].shape

    def itemsize(self, key: str) -> int:
        return self._stored[key].itemsize

    def copy_blocks(self, blocks: list[Block]) -> None:
        rows = []
        for block in blocks:
            stored = self._stored[block.key]
            if stored.dtype is not None and _is_row_block(block.index, stored.shape) and block.out.is_contiguous():
                rows.append(RowBlock(stored, block.index[0], block.out))
                continue
            # get_slice reads only the requested byte ranges; a 0-d tensor has nothing to slice.
            mapped = self._map()
            piece = mapped.get_slice(block.key)[block.index] if block.index else mapped.get_tensor(block.key)
            block.out.copy_(piece)  # casts only the slice: casting the whole tensor would touch all of it
        if rows:
            if self._rows is None:
                self._rows = self._closing.enter_context(closing(RowBlockReader(str(self._path))))
            self._rows.copy_blocks(rows)

    def _map(self):  # a safetensors handle
        if self._mapped is None:
            from safetensors import safe_open

            self._mapped = self._closing.enter_context(safe_open(str(self._path), framework="pt", device="cpu"))
        return self._mapped

    def close(self) -> None:
        self._closing.close()


def _is_row_block(index: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether `index` takes whole rows: full extent on every dimension after the first."""
    return bool(index) and all(s.start == 0 and s.stop == size for s, size in zip(index[1:], shape[1:], strict=True))


class _StateDictReader:
    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._state_dict = state_dict

    direct_io = False

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._state_dict[key].shape)

    def itemsize(self, key: str) -> int:
        return self._state_dict[key].element_size()

    def copy_blocks(self, blocks: list[Block]) -> None:
        for block in blocks:
            block.out.copy_(self._state_dict[block.key][block.index])


@contextmanager
def open_reader(files: CheckpointFiles, file_name: str) -> Iterator[SliceReader]:
    """Open one checkpoint file for slicing; .bin files are pickles and are mapped whole (mmap)."""
    path = files.directory / file_name
    if files.file_format == "safetensors":
        reader = _SafetensorsReader(path, files.header(file_name))
        try:
            yield reader
        finally:
            reader.close()
        return
    state_dict = _load_bin(path)
    try:
        yield _StateDictReader(state_dict)
    finally:
        del state_dict
