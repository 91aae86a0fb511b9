"""What a snapshot in host memory holds, and where each tensor lies in a slot.

The tracked state's tensors, keyed "model.<fqn>" (trainable parameters, persistent buffers) and
"optim.<fqn>.<state name>", each a rank's local shard; an `Entry` per tensor gives its offset in
the slot, so a slot is one flat buffer that a single copy fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
    buffers = {}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                buffers[f"model.{module_name}.{name}".replace("model..", "model.")] = buffer
    return buffers


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
