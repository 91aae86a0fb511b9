"""What a snapshot in host memory holds, and where each tensor lies in a slot.

The tracked state's tensors, keyed "model.<fqn>" (trainable parameters, persistent buffers) and
"optim.<fqn>.<state name>", each a rank's local shard; an `Entry` per tensor gives its offset in
the slot, so a slot is one flat buffer that a single copy fills. Finding those tensors walks the
model and the optimizer's state, which costs more than the copy: `live_tensors_of` finds them
again only when what holds them changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.module_buffers import buffers_by_persistence

_ALIGN = 64


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one tensor of the snapshot lies in a slot, and what it is."""

    key: str
    """"model.<fqn>" or "optim.<fqn>.<state name>"."""
    shape: tuple[int, ...]
    """This rank's local shape."""
    dtype: str
    offset: int
    num_bytes: int
    sharded: bool
    """A DTensor's local shard (restored into one, made like its parameter if missing)."""
    on_cpu: bool
    """Kept on the CPU whatever the parameter's device (Adam's `step`)."""

    def as_json(self) -> list:
        return [self.key, list(self.shape), self.dtype, self.offset, self.num_bytes, self.sharded, self.on_cpu]

    @classmethod
    def from_json(cls, row: list) -> Entry:
        key, shape, dtype, offset, num_bytes, sharded, on_cpu = row
        return cls(key, tuple(shape), dtype, offset, num_bytes, sharded, on_cpu)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def live_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """What a snapshot copies, by key, in a fixed order: the trainable parameters and persistent
    buffers of `model`, then each optimizer state tensor (frozen parameters come from the
    pretrained weights, as for disk checkpoints)."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for fqn, param in model.named_parameters():
        names[id(param)] = fqn
        if param.requires_grad:
            tensors[f"model.{fqn}"] = param
    tensors.update(persistent_buffers(model))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                for state_name, value in sorted(optimizer.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        tensors[f"optim.{names.get(id(param), '?')}.{state_name}"] = value
    return tensors


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by key: what a forward may update in place (running statistics)."""
    return {f"model.{name}": buffer for name, buffer in buffers_by_persistence(model, persistent=True).items()}


def layout_of(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    entries, offset = [], 0
    for key, tensor in tensors.items():
        local = local_shard(tensor)
        num_bytes = local.numel() * local.element_size()
        entries.append(Entry(key, tuple(local.shape), str(local.dtype).removeprefix("torch."), offset, num_bytes,
                             isinstance(tensor, DTensor), key.startswith("optim.") and tensor.device.type == "cpu"))
        offset += -(-num_bytes // _ALIGN) * _ALIGN
    return entries


def layout_bytes(entries: list[Entry]) -> int:
    return max((entry.offset + entry.num_bytes for entry in entries), default=0)


def mesh_description(model: nn.Module) -> str:
    """The device mesh the model's parameters are sharded over, as the manifest records it."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            return f"{mesh.device_type}{tuple(mesh.shape)}{tuple(mesh.mesh_dim_names or ())}"
    return "unsharded"


@dataclass(slots=True)
class LiveTensors:
    """The tensors a snapshot copies, as found in the live model and optimizer."""

    holders: list[Any]
    """The model, the optimizer, its state mapping and each parameter's state dict, held so that
    none is freed and its id() reused by another while compared by identity."""
    layout: list[Entry]
    sources: list[torch.Tensor]
    """Each entry's local tensor, detached: what is copied (buffers: their copy set aside)."""
    buffers: list[tuple[int, torch.Tensor, torch.Tensor]]
    """(index in sources, live buffer, its copy set aside) for what a forward updates in place."""
    mesh: str
    live: list[torch.Tensor]
    """The tracked tensors themselves, in layout order."""
    pointers: list[int]
    """Where each one's local tensor lay when found."""


def live_tensors_of(tracked: Tracked, cached: LiveTensors | None) -> LiveTensors:
    """`cached`, or the tensors found afresh when the model, the optimizer or a parameter's state
    dict is another object, or a tensor was moved (`model.to()`). Parameters or state tensors
    replaced by other objects behind the optimizer's back are not noticed: the caller forgets
    `cached` then."""
    optimizer = tracked.optimizer
    holders = [tracked.model, optimizer]
    if optimizer is not None:
        holders += [optimizer.state, *optimizer.state.values()]
    if (cached is None or len(cached.holders) != len(holders)
            or any(old is not new for old, new in zip(cached.holders, holders, strict=True))
            or _local_pointers(cached.live) != cached.pointers):
        cached = _found(tracked.model, optimizer, holders)
    return cached


def _found(model: nn.Module, optimizer: torch.optim.Optimizer | None, holders: list[Any]) -> LiveTensors:
    """The tensors a snapshot of `model` and `optimizer` copies, with a copy set aside for each buffer."""
    tensors = live_tensors(model, optimizer)
    buffer_keys = persistent_buffers(model).keys()
    with torch.no_grad():
        sources = [local_shard(tensor).detach() for tensor in tensors.values()]
    buffers = []
    for index, key in enumerate(tensors):
        if key in buffer_keys:
            aside = torch.empty_like(sources[index])
            buffers.append((index, sources[index], aside))
            sources[index] = aside
    live = list(tensors.values())
    return LiveTensors(holders=holders, layout=layout_of(tensors), sources=sources, buffers=buffers,
                       mesh=mesh_description(model), live=live, pointers=_local_pointers(live))


def _local_pointers(tensors: list[torch.Tensor]) -> list[int]:
    with torch.no_grad():  # a DTensor's local tensor, without autograd's view
        return [local_shard(tensor).data_ptr() for tensor in tensors]
