"""`engine.move_buffers` puts every buffer on the compute device and keeps whether each is saved
with the model (persistent) as it was, at the root and in nested modules."""

from __future__ import annotations

import torch
from torch import nn

from fsdp2nb.checkpoint.snapshot_layout import persistent_buffers
from fsdp2nb.engine.engine import move_buffers
from fsdp2nb.module_buffers import non_persistent_buffer_names


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(2), persistent=False)
        self.register_buffer("scale", torch.ones(1))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Rotary() for _ in range(2))
        self.register_buffer("embed_scale", torch.ones(1), persistent=False)
        self.register_buffer("position_ids", torch.arange(3))


def test_every_buffer_moves_and_keeps_whether_it_is_saved():
    model = Model()
    saved_before = sorted(model.state_dict())
    move_buffers(model, torch.device("meta"))
    assert all(buffer.device.type == "meta" for buffer in model.buffers())
    assert sorted(model.state_dict()) == saved_before == [
        "layers.0.scale", "layers.1.scale", "position_ids"]


class RenamingWrapper(nn.Module):
    """Renames its keys in `state_dict()`, as activation checkpointing's wrapper does."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped = Rotary()
        self.register_state_dict_post_hook(_drop_wrapped_prefix)


def _drop_wrapped_prefix(module, state_dict, prefix, local_metadata) -> None:
    for key in [key for key in state_dict if key.startswith(f"{prefix}wrapped.")]:
        state_dict[key.replace("wrapped.", "", 1)] = state_dict.pop(key)


def test_persistence_is_read_from_each_module_not_from_renamed_state_dict_keys():
    model = nn.Sequential(RenamingWrapper())
    assert sorted(model.state_dict()) == ["0.scale"]  # renamed: "0.wrapped.scale" is saved
    assert non_persistent_buffer_names(model) == ["0.wrapped.inv_freq"]
    assert list(persistent_buffers(model)) == ["model.0.wrapped.scale"]
