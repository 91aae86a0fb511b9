"""Sharded model + optimizer state as one DCP save, and a check of a checkpoint before loading it.

Both sides build the state with `get_state_dict`, so keys are the model's fully qualified names
whatever the sharding, and a checkpoint written on N ranks loads on M. When some parameters are
frozen (a LoRA base), only trainable ones are saved: the base comes from the pretrained weights.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from fsdp2nb.errors import CheckpointMismatchError

logger = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIM_KEY = "optim"
_MAX_LISTED = 8


def has_frozen_params(model: nn.Module) -> bool:
    """True when some parameters do not train (a LoRA base): those are left out of checkpoints."""
    return any(not p.requires_grad for p in model.parameters())


def state_dict_options(model: nn.Module) -> StateDictOptions:
    frozen = has_frozen_params(model)
    # strict=False on load: the frozen parameters are absent from the checkpoint by design.
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def get_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} holding each rank's shards (DTensors share the live storage)."""
    options = state_dict_options(model)
    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model, options=options)}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {MODEL_KEY: model_state, OPTIM_KEY: optim_state}


def training_state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state a save writes, leaving an optimizer that has never stepped without state.

    `get_state_dict` gives an optimizer without state a zero-lr step to create it, which sets
    Adam's step count: kept, it would change the training after a save before the first step.
    The saved state holds its own references to those zeros; the rank's file records that the
    optimizer had not stepped (`rank_file.capture_rank_state`), and a load clears it again.
    """
    never_stepped = optimizer is not None and not optimizer.state
    state = get_training_state(model, optimizer)
    if never_stepped:
        optimizer.state.clear()
    return state


def snapshot_training_state(tracked: Any, views: dict[str, torch.Tensor], param_groups: list[dict]) -> dict[str, Any]:
    """The state `get_training_state` gives, holding a memory snapshot's tensors (`views`, keyed as
    snapshot_layout.live_tensors keys them) instead of the live ones, for saving it to disk."""
    state = get_training_state(tracked.model, tracked.optimizer)
    model_state = state[MODEL_KEY]
    for fqn, live in model_state.items():
        if f"model.{fqn}" in views:
            model_state[fqn] = _like(live, views[f"model.{fqn}"])
    if OPTIM_KEY in state:
        for fqn, entries in state[OPTIM_KEY]["state"].items():
            for name, live in entries.items():
                if isinstance(live, torch.Tensor) and f"optim.{fqn}.{name}" in views:
                    entries[name] = _like(live, views[f"optim.{fqn}.{name}"])
        for group, saved in zip(state[OPTIM_KEY]["param_groups"], param_groups, strict=True):
            group.update(saved)  # its "params" (names) stay
    return state


def _like(live: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as `live` is: a DTensor's shard keeps its mesh and placements."""
    if isinstance(live, DTensor):
        return DTensor.from_local(local, live.device_mesh, live.placements, run_check=False,
                                  shape=live.shape, stride=live.stride())
    return local


def set_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
    options = state_dict_options(model)
    if optimizer is None:
        set_model_state_dict(model, state[MODEL_KEY], options=options)
        return
    set_state_dict(model, optimizer, model_state_dict=state[MODEL_KEY],
                   optim_state_dict=state[OPTIM_KEY], options=options)


def read_dcp_metadata(ckpt_dir: str | os.PathLike) -> Metadata:
    return FileSystemReader(ckpt_dir).read_metadata()


def check_state_matches(state: dict[str, Any], metadata: Metadata, ckpt_dir: str | os.PathLike) -> None:
    """Raise CheckpointMismatchError if `state` and the checkpoint disagree on keys or global shapes.

    Done before anything is loaded: `dcp.load` writes into live parameters as it goes, so a
    mismatch found halfway would leave the model half restored.
    """
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator=False)
    ours = planner.state_dict  # flattened: "model.lm_head.weight", "optim.state.<fqn>.exp_avg", ...
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in ours if k not in saved)
    roots = {k.split(".", 1)[0] for k in state}
    unexpected = sorted(k for k in saved if k.split(".", 1)[0] in roots and k not in ours
                        and k.startswith(MODEL_KEY + "."))
    wrong_shape = [
        f"{k} {tuple(saved[k].size)} in checkpoint vs {tuple(v.shape)} here"
        for k, v in ours.items()
        if k in saved and isinstance(v, torch.Tensor) and isinstance(saved[k], TensorStorageMetadata)
        and tuple(saved[k].size) != tuple(v.shape)
    ]
    problems = [("missing from checkpoint", missing), ("not in model", unexpected), ("shape differs", wrong_shape)]
    found = [f"{label}: {_short(items)}" for label, items in problems if items]
    if found:
        raise CheckpointMismatchError(f"checkpoint {ckpt_dir} does not match the model: " + "; ".join(found))


def checked_training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                           metadata: Metadata, ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The state to load into, after checking it against the checkpoint; on a mismatch nothing changed."""
    # get_state_dict gives an optimizer without state a zero-lr step to create it; undone on failure.
    fresh_optimizer = optimizer is not None and not optimizer.state
    try:
        state = get_training_state(model, optimizer)
        check_state_matches(state, metadata, ckpt_dir)
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()
        raise
    return state


def _short(items: list[str]) -> str:
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more
