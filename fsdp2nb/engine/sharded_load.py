"""Fill a materialised, fully_shard-ed model with the checkpoint slices this rank owns.

Each parameter is a DTensor; DTensor tells us which block of the full tensor this rank holds
(`compute_local_shape_and_global_offset` with the parameter's own mesh and placements), and only
that block is read from disk and then cast to the parameter's dtype. Buffers are not sharded and
are read whole.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp2nb import progress
from fsdp2nb.engine.direct_reads import release_spare_buffers
from fsdp2nb.engine.hf_files import Block, CheckpointFiles, open_reader
from fsdp2nb.engine.key_mapping import checkpoint_to_model_keys, hf_key, unwrap_peft
from fsdp2nb.errors import CheckpointMismatchError, MissingWeights

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class LoadReport:
    """What one rank's sharded load did."""

    num_loaded: int = 0
    """State-dict entries (tied aliases counted once) filled from the checkpoint."""
    initialized: list[str] = field(default_factory=list)
    """Keys filled from in-memory initial values (new LoRA adapters)."""
    zero_filled: list[str] = field(default_factory=list)
    """Keys absent from the checkpoint but allowed by `allow_missing`; they were set to zero."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint keys no model entry asked for."""
    bytes_requested: int = 0
    """Checkpoint bytes this rank asked the readers for (slice sizes in the stored dtype)."""
    direct_io: bool = False
    """Whether some file was read past the page cache (O_DIRECT): it was not cached."""


@dataclass(frozen=True, slots=True)
class _Target:
    keys: tuple[str, ...]  # every state-dict name of one tensor (more than one when tied)
    tensor: torch.Tensor


def state_dict_targets(model: nn.Module) -> list[_Target]:
    """One target per distinct parameter/persistent buffer, with all names it is known by."""
    names: dict[int, list[str]] = defaultdict(list)
    tensors: dict[int, torch.Tensor] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        names[id(tensor)].append(key)
        tensors[id(tensor)] = tensor
    return [_Target(tuple(keys), tensors[ident]) for ident, keys in names.items()]


def local_block(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the local storage of `tensor`, the index of that block inside the full tensor)."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
    else:
        shape, offset, local = tuple(tensor.shape), (0,) * tensor.dim(), tensor
    return local, tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


@torch.no_grad()
def load_sharded(
    model: nn.Module,
    files: CheckpointFiles,
    *,
    initial_values: dict[str, torch.Tensor] | None = None,
    allow_missing: Sequence[str] = (),
) -> LoadReport:
    """Copy this rank's block of every parameter and persistent buffer from `files`.

    `initial_values` holds full tensors, keyed by model key, for entries that are new rather than
    loaded (LoRA adapters). `allow_missing` holds fnmatch patterns of model keys that may be absent
    from the checkpoint. Any other absent key raises KeyError naming it.
    """
    initial_values = initial_values or {}
    report = LoadReport()
    hf_model, is_peft = unwrap_peft(model)
    targets = state_dict_targets(model)
    wanted = {hf_key(k, is_peft) for t in targets for k in t.keys if k not in initial_values}
    source_of = checkpoint_to_model_keys(hf_model, files.key_to_file, wanted)
    by_file: dict[str, list[tuple[str, _Target]]] = defaultdict(list)
    used: set[str] = set()
    for target in targets:
        ckpt_key = _checkpoint_key(target, source_of, is_peft)
        if ckpt_key is not None:
            by_file[files.key_to_file[ckpt_key]].append((ckpt_key, target))
            used.add(ckpt_key)
        else:
            _fill_without_checkpoint(target, initial_values, allow_missing, report)
    task = _start_progress(by_file)
    try:
        for file_name, entries in by_file.items():
            _copy_from_file(files, file_name, entries, report)
            if task is not progress.SILENT:
                task.advance(sum(_local_bytes(target) for _, target in entries), len(entries))
    except BaseException as error:
        task.finish(error)
        raise
    finally:
        release_spare_buffers()
    task.finish()
    report.unexpected = sorted(set(files.key_to_file) - used)
    if report.unexpected:
        logger.warning("checkpoint keys not used by the model: %s", report.unexpected)
    return report


def _start_progress(by_file: dict[str, list[tuple[str, _Target]]]) -> progress.AnyTask:
    """Progress in this rank's bytes (in the model's dtype) and tensors; totals only when someone listens."""
    if not progress.listening():
        return progress.SILENT
    targets = [target for entries in by_file.values() for _, target in entries]
    return progress.start_task("load_model", "loading model weights", sum(map(_local_bytes, targets)), len(targets))


def _local_bytes(target: _Target) -> int:
    local = target.tensor.to_local() if isinstance(target.tensor, DTensor) else target.tensor
    return local.numel() * local.element_size()


def _checkpoint_key(target: _Target, source_of: dict[str, str], is_peft: bool) -> str | None:
    for key in target.keys:
        found = source_of.get(hf_key(key, is_peft))
        if found is not None:
            return found
    return None


def _fill_without_checkpoint(
    target: _Target, initial_values: dict[str, torch.Tensor], allow_missing: Sequence[str], report: LoadReport
) -> None:
    local, index = local_block(target.tensor)
    for key in target.keys:
        if key in initial_values:
            local.copy_(initial_values[key][index])
            report.initialized.append(key)
            return
    if any(fnmatch.fnmatchcase(key, pattern) for key in target.keys for pattern in allow_missing):
        local.zero_()
        report.zero_filled.extend(target.keys)
        logger.warning("not in the checkpoint, set to zero (allowed): %s", list(target.keys))
        return
    raise MissingWeights(
        f"checkpoint has no tensor for model key(s) {list(target.keys)}; pass allow_missing=[...] "
        "with a matching pattern to start them at zero"
    )


def _copy_from_file(
    files: CheckpointFiles, file_name: str, entries: list[tuple[str, _Target]], report: LoadReport
) -> None:
    with open_reader(files, file_name) as reader:
        blocks = []
        for ckpt_key, target in entries:
            full_shape = reader.shape(ckpt_key)
            if full_shape != tuple(target.tensor.shape):
                raise CheckpointMismatchError(
                    f"checkpoint key {ckpt_key!r} has shape {full_shape} but model key "
                    f"{target.keys[0]!r} expects {tuple(target.tensor.shape)}"
                )
            local, index = local_block(target.tensor)
            if local.numel():
                blocks.append(Block(ckpt_key, index, local))
                report.bytes_requested += local.numel() * reader.itemsize(ckpt_key)
            report.num_loaded += 1
        reader.copy_blocks(blocks)  # every shape checked first: a mismatch changes nothing
        report.direct_io |= reader.direct_io
