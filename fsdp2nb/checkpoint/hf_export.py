"""Export a (sharded) model as a Hugging Face directory that `from_pretrained` loads.

No rank ever holds the whole model. Tensors are assigned to ranks, balanced by size; for each
tensor, in the same order on every rank, the full value is gathered (one tensor at a time) and
kept only by its owner, which writes its tensors into its own safetensors files. Rank 0 then
names the files `model-0000i-of-0000N.safetensors`, writes the index and the config.

A peft model exports its adapter (adapter_model.safetensors + adapter_config.json, small enough
to gather on rank 0); `merge_lora=True` also writes the merged full model under `output_dir/merged`.

An export is staged beside `output_dir` and swapped in whole when complete and durable
(directory_swap.py), so a failure or a crash leaves the previous export as it was: never a
directory without loadable weights. Files there that an export does not write (a README,
tokenizer files when no processor is given) are carried over; earlier weights, configs and
adapters are not. Nothing should write into `output_dir` during an export: it would write into
the tree being replaced. A mount point is filled file by file instead, which is not atomic.

A failure on one rank is made known to all (the steps only rank 0 runs are followed by a
broadcast of their outcome, and a rank that cannot write its files still takes part in every
gather), so no rank is left waiting in a collective.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2nb import progress
from fsdp2nb.checkpoint import directory_swap
from fsdp2nb.checkpoint.layout import fsync_file
from fsdp2nb.collectives import (
    all_ranks_succeeded,
    get_rank,
    get_world_size,
    is_distributed,
    make_dir_everywhere,
    make_dir_on_rank0_then_everywhere,
    on_rank0_agreed,
)
from fsdp2nb.errors import InvalidValue, NotSupported

logger = logging.getLogger(__name__)

_EXPORT = "the HF export"

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class _Entry:
    """One output tensor: its Hugging Face key, element count and how to build its full value."""

    key: str
    numel: int
    full: Callable[[], torch.Tensor]  # collective when sharded: every rank calls it, in order


@dataclass(frozen=True, slots=True)
class _WrittenFile:
    """A safetensors file one rank wrote, reported to rank 0 for naming and indexing."""

    path: str
    keys: tuple[str, ...]
    num_bytes: int


def export_hf(model: nn.Module, output_dir: str | os.PathLike, *, processor=None,
              dtype: torch.dtype | None = None, merge_lora: bool = False,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `model` (plain or peft, sharded or not) to `output_dir` for `from_pretrained`, as
    `fsdp2nb.export_hf(model, output_dir, processor=tokenizer)`; collective, call on every rank.

    `dtype`: of the written weights (default: the model's first floating parameter's; e.g.
    `engine.compute_dtype` for bf16 weights from fp32 ones). `merge_lora=True` (peft models)
    also writes the merged model under `output_dir/merged`. Returns the resolved `output_dir`.
    """
    if max_shard_bytes < 1:
        raise InvalidValue(f"max_shard_bytes={max_shard_bytes!r} must be >= 1")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidValue(f"dtype={dtype!r} must be None or a floating torch.dtype")
    output_dir = Path(output_dir).resolve()  # through a symlink: replace what it points at, not the link
    if output_dir.exists() and not output_dir.is_dir():
        raise InvalidValue(f"output_dir={str(output_dir)!r} is a file; pass a directory (new or earlier export)")
    dtype = dtype or _model_dtype(model)
    is_peft = isinstance(getattr(model, "peft_config", None), dict)
    if merge_lora and not is_peft:
        raise InvalidValue("merge_lora=True needs a peft model; this one has no peft_config")
    staging = on_rank0_agreed(lambda: directory_swap.start_staging(output_dir), _EXPORT)
    try:
        make_dir_everywhere(staging, _EXPORT)  # storage that is not shared between hosts
        _write_export(model, staging, processor, dtype, merge_lora, is_peft, max_shard_bytes)
        on_rank0_agreed(lambda: directory_swap.commit_staging(staging, output_dir, carry=_is_user_file), _EXPORT)
    except BaseException:
        if get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("exported %s to %s", type(model).__name__, output_dir)
    return output_dir


def _write_export(model: nn.Module, out: Path, processor, dtype: torch.dtype, merge_lora: bool, is_peft: bool,
                  max_shard_bytes: int) -> None:
    if is_peft:
        _export_adapter(model, out, dtype)
        if merge_lora:
            merged_dir = out / "merged"
            make_dir_on_rank0_then_everywhere(merged_dir, _EXPORT)
            _export_full(_merged_entries(model), model.get_base_model().config, merged_dir, dtype,
                         max_shard_bytes, model)
    else:
        _export_full(_plain_entries(model), model.config, out, dtype, max_shard_bytes, model)
    if processor is not None:
        on_rank0_agreed(lambda: processor.save_pretrained(out), _EXPORT)


# ---- full model --------------------------------------------------------------------------------


def _export_full(entries: list[_Entry], config, out: Path, dtype: torch.dtype, max_shard_bytes: int,
                 model: nn.Module) -> None:
    owners = _assign_owners(entries, get_world_size())
    rank = get_rank()
    owned_bytes = sum(e.numel for e, owner in zip(entries, owners, strict=True) if owner == rank) * dtype.itemsize
    task = progress.start_task("export", "exporting in Hugging Face format", owned_bytes, len(entries))
    written, error = _write_owned(entries, owners, out, dtype, max_shard_bytes, task)
    task.finish(error)
    all_ranks_succeeded(error, _EXPORT)
    all_written = _gather_to_rank0(written)
    written = [f for files in all_written for f in files]
    on_rank0_agreed(lambda: _finish_full(out, written, config, dtype, model), _EXPORT)


def _finish_full(out: Path, files: list[_WrittenFile], config, dtype: torch.dtype, model: nn.Module) -> None:
    """Rank 0: name the files, write the index and the configs."""
    _name_files_and_index(out, files)
    _write_config(config, out, dtype)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out)


def _plain_entries(model: nn.Module) -> list[_Entry]:
    """State dict keys as save_pretrained writes them; a tied tensor is written once, under its first key."""
    seen: set[int] = set()
    entries = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # tied weight (lm_head = embed_tokens): from_pretrained re-ties it
        seen.add(id(tensor))
        entries.append(_Entry(key, tensor.numel(), _full_getter(tensor)))
    return entries


def _merged_entries(model: nn.Module) -> list[_Entry]:
    """The base model's keys with each LoRA delta (B @ A * scaling) folded into its base weight."""
    adapter = _single_adapter(model)
    prefix = "base_model.model."
    seen: set[int] = set()
    entries = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if "lora_" in key or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        hf_key = key.removeprefix(prefix).replace(".base_layer.", ".")
        module_name = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        getter = _full_getter(tensor)
        if module_name is not None and key.endswith(".base_layer.weight"):
            getter = _merged_getter(model.get_submodule(module_name), adapter, getter)
        entries.append(_Entry(hf_key, tensor.numel(), getter))
    return entries


def _merged_getter(lora_module: nn.Module, adapter: str, base: Callable[[], torch.Tensor]):
    if getattr(lora_module, "use_dora", {}).get(adapter, False):
        raise NotSupported("merge_lora does not support DoRA adapters yet")

    def full() -> torch.Tensor:
        weight = base()
        a = _full_getter(lora_module.lora_A[adapter].weight)()  # (r, in_features)
        b = _full_getter(lora_module.lora_B[adapter].weight)()  # (out_features, r)
        delta = (b.float() @ a.float()) * lora_module.scaling[adapter]
        if getattr(lora_module, "fan_in_fan_out", False):
            delta = delta.T
        return (weight.float() + delta).to(weight.dtype)

    return full


def _assign_owners(entries: list[_Entry], world_size: int) -> list[int]:
    """Greedy balance by element count, largest first; the same answer on every rank."""
    loads = [0] * world_size
    owners = [0] * len(entries)
    for i in sorted(range(len(entries)), key=lambda i: (-entries[i].numel, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += entries[i].numel
    return owners


def _write_owned(entries: list[_Entry], owners: list[int], out: Path, dtype: torch.dtype,
                 max_shard_bytes: int, task: progress.AnyTask = progress.SILENT,
                 ) -> tuple[list[_WrittenFile], Exception | None]:
    """(the files this rank wrote, the error that stopped its writing). After an error (a full
    disk) the rank keeps taking part in the gathers, so the others are not left waiting."""
    rank = get_rank()
    written: list[_WrittenFile] = []
    buffer: dict[str, torch.Tensor] = {}
    buffered_bytes = 0
    error: Exception | None = None
    for entry, owner in zip(entries, owners, strict=True):
        full = entry.full()  # every rank takes part in the gather; only the owner keeps the result
        task.advance(entry.numel * dtype.itemsize if owner == rank else 0, 1)
        if owner != rank or error is not None:
            continue
        tensor = full.to(dtype) if full.is_floating_point() else full
        buffer[entry.key] = tensor.detach().cpu().contiguous()
        buffered_bytes += tensor.numel() * tensor.element_size()
        if buffered_bytes >= max_shard_bytes:
            error = _flush_into(written, buffer, out)
            buffer, buffered_bytes = {}, 0
    if buffer and error is None:
        error = _flush_into(written, buffer, out)
    return written, error


def _flush_into(written: list[_WrittenFile], tensors: dict[str, torch.Tensor], out: Path) -> Exception | None:
    try:
        written.append(_flush(tensors, out / f".part-rank{get_rank():05d}-{len(written):05d}.safetensors"))
    except Exception as error:  # reported to every rank by all_ranks_succeeded
        return error
    return None


def _flush(tensors: dict[str, torch.Tensor], path: Path) -> _WrittenFile:
    save_file(tensors, path, metadata={"format": "pt"})
    fsync_file(path)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return _WrittenFile(path=str(path), keys=tuple(tensors), num_bytes=num_bytes)


def _name_files_and_index(out: Path, files: list[_WrittenFile]) -> None:
    """Rank 0: final file names and the index from_pretrained reads."""
    weight_map: dict[str, str] = {}
    for i, written in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.replace(written.path, out / name)
        weight_map.update(dict.fromkeys(written.keys, name))
    index = {"metadata": {"total_size": sum(f.num_bytes for f in files)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / _INDEX_FILE).write_text(json.dumps(index, indent=2))


def _write_config(config, out: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.save_pretrained(out)


# ---- peft adapter ------------------------------------------------------------------------------


def _export_adapter(model: nn.Module, out: Path, dtype: torch.dtype) -> None:
    """adapter_model.safetensors + adapter_config.json; the adapter is small, so rank 0 gathers it."""
    from peft import get_peft_model_state_dict

    adapter = _single_adapter(model)
    full_state = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if "lora_" not in key and not tensor.requires_grad:
            continue
        full = _full_getter(tensor)()
        if get_rank() == 0:
            full_state[key] = full.to(dtype) if full.is_floating_point() else full

    def save() -> None:
        adapter_state = get_peft_model_state_dict(model, state_dict=full_state, adapter_name=adapter)
        save_file({k: v.contiguous() for k, v in adapter_state.items()}, out / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        model.peft_config[adapter].save_pretrained(out)

    on_rank0_agreed(save, _EXPORT)


def _single_adapter(model: nn.Module) -> str:
    adapter = getattr(model, "active_adapter", "default")
    if not isinstance(adapter, str):
        raise NotSupported(f"export of several active adapters {adapter!r} is not supported")
    return adapter


# What an export writes; an earlier export's files of these kinds are not carried into a new one
# (an old single-file model.safetensors beside a new index would be loaded instead of it).
_EXPORT_OUTPUTS = ("model*.safetensors*", "pytorch_model*.bin*", "adapter_model.*", "adapter_config.json",
                   "config.json", "generation_config.json", "merged")


def _is_user_file(name: str) -> bool:
    """Whether an entry of an earlier export's directory is kept: anything an export does not write."""
    return not any(fnmatch.fnmatchcase(name, pattern) for pattern in _EXPORT_OUTPUTS)


# ---- small collective helpers ------------------------------------------------------------------


def _full_getter(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    def full() -> torch.Tensor:
        value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return value.detach()

    return full


def _model_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _gather_to_rank0(written: list[_WrittenFile]) -> list[list[_WrittenFile]]:
    if not is_distributed():
        return [written]
    gathered: list[list[_WrittenFile] | None] = [None] * get_world_size() if get_rank() == 0 else []
    dist.gather_object(written, gathered if get_rank() == 0 else None, dst=0)
    return [files or [] for files in gathered]

