"""A snapshot in host memory put back into the live model and optimizer, on one rank.

Besides its tensors a snapshot keeps the rank's other state (step, RNG streams, the optimizer's
hyperparameters, the scheduler, extras), captured here beside the code that applies it, so that
both name the same fields. Before anything changes, a snapshot is checked against the live state
(another model, mesh or optimizer is refused in one line) and the optimizer state a fresh
optimizer has not made yet is allocated; copying back is then bitwise and cannot refuse.
The ranks' agreement around these steps is memory_snapshots.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fsdp2nb.checkpoint import plain_pickle
from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.checkpoint.rng import capture_rng_state, restore_rng_state
from fsdp2nb.checkpoint.snapshot_layout import Entry, layout_of, live_tensors, local_shard, mesh_description
from fsdp2nb.checkpoint.snapshot_slots import Slot
from fsdp2nb.errors import MemorySnapshotRefused

_MAX_LISTED = 4
_OTHER_STATE_KEYS = {"step", "rng", "param_groups", "scheduler", "extra"}


def other_state(tracked: Tracked, step: int) -> bytes:
    """What the snapshot keeps besides tensors, pickled at once (plain_pickle, which refuses what
    it could not read back: `Unkeepable`)."""
    optimizer = tracked.optimizer
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in optimizer.param_groups] if optimizer is not None else []
    return plain_pickle.dumps({
        "step": step, "rng": capture_rng_state(), "param_groups": groups,
        "scheduler": dict(tracked.scheduler.state_dict()) if tracked.scheduler is not None else None,
        "extra": {name: obj.state_dict() for name, obj in tracked.extra.items()},
    })


def loaded_other_state(data: bytes, step: int, path: Path) -> dict[str, Any]:
    """The other state `other_state` kept for `step` (read from `path`); refused if it is not a snapshot's."""
    state = plain_pickle.loads(data)
    if not isinstance(state, dict) or not _OTHER_STATE_KEYS <= state.keys():
        raise MemorySnapshotRefused(f"the state of step {step} in {path} is not a snapshot's")
    return state


def check_matches(tracked: Tracked, layout: list[Entry], state: dict[str, Any], *, directory: str,
                  taken_on_mesh: str | None) -> None:
    """Refuse (`MemorySnapshotRefused`) a snapshot of another model, mesh or optimizer."""
    optimizer = tracked.optimizer
    if optimizer is not None and len(state["param_groups"]) != len(optimizer.param_groups):
        raise MemorySnapshotRefused(f"the snapshot's optimizer has {len(state['param_groups'])} parameter groups, "
                                    f"this one {len(optimizer.param_groups)}; nothing was changed")
    mesh = mesh_description(tracked.model)
    if taken_on_mesh != mesh:
        raise MemorySnapshotRefused(f"the snapshot of {directory} was taken on the mesh {taken_on_mesh}, "
                                    f"this model is sharded on {mesh}; nothing was changed")
    live = {entry.key: entry for entry in layout_of(live_tensors(tracked.model, None))}
    saved = {entry.key: entry for entry in layout if entry.key.startswith("model.")}
    differ = [key for key in saved.keys() | live.keys()
              if key not in live or key not in saved or (saved[key].shape, saved[key].dtype)
              != (live[key].shape, live[key].dtype)]
    if differ:
        listed = ", ".join(sorted(differ)[:_MAX_LISTED]) + (" ..." if len(differ) > _MAX_LISTED else "")
        raise MemorySnapshotRefused(f"the snapshot of {directory} in host memory is of another model "
                                    f"({len(differ)} tensors differ: {listed}); nothing was changed: "
                                    "`%fsdp2 stop` frees it (or use another directory)")
    params = {f"optim.{fqn}." for fqn, param in tracked.model.named_parameters() if param.requires_grad}
    for entry in layout:
        if entry.key.startswith("optim.") and tracked.optimizer is None:
            raise MemorySnapshotRefused("the snapshot holds optimizer state but no optimizer is tracked; "
                                        "track the optimizer too; nothing was changed")
        if entry.key.startswith("optim.") and not any(entry.key.startswith(prefix) for prefix in params):
            raise MemorySnapshotRefused(f"the snapshot's {entry.key} names no trainable parameter of this "
                                        "model; nothing was changed")


def missing_optimizer_state(slot: Slot, layout: list[Entry], tracked: Tracked) -> dict[str, torch.Tensor]:
    """Optimizer state that a fresh optimizer has not made yet (or of another shape), made like its
    parameter from the slot, by key: before the ranks agree, so that what allocates fails first."""
    optimizer = tracked.optimizer
    if optimizer is None:
        return {}
    params = dict(tracked.model.named_parameters())
    made = {}
    for entry in layout:
        if not entry.key.startswith("optim."):
            continue
        fqn, _, name = entry.key.removeprefix("optim.").rpartition(".")
        current = optimizer.state.get(params[fqn], {}).get(name)
        if not (isinstance(current, torch.Tensor) and tuple(local_shard(current).shape) == entry.shape):
            made[entry.key] = _made_like(params[fqn], slot.view(entry), entry)
    return made


def copy_back(slot: Slot, layout: list[Entry], tracked: Tracked, made: dict[str, torch.Tensor],
              state: dict[str, Any]) -> None:
    """Put the slot's tensors (`made`: state made beforehand) and the other state into the live
    model, optimizer, scheduler, extras and RNG streams."""
    _copy_tensors_back(slot, layout, tracked, made)
    _apply_other_state(tracked, state)


def _copy_tensors_back(slot: Slot, layout: list[Entry], tracked: Tracked, made: dict[str, torch.Tensor]) -> None:
    live = live_tensors(tracked.model, None)
    params = dict(tracked.model.named_parameters())
    optimizer = tracked.optimizer
    with torch.no_grad():
        for entry in layout:
            if entry.key.startswith("model."):
                local_shard(live[entry.key]).copy_(slot.view(entry))
                continue
            assert optimizer is not None, "checked before: optimizer state needs an optimizer"
            fqn, _, name = entry.key.removeprefix("optim.").rpartition(".")
            state = optimizer.state[params[fqn]]
            if entry.key in made:
                state[name] = made[entry.key]
            else:
                local_shard(state[name]).copy_(slot.view(entry))


def _apply_other_state(tracked: Tracked, state: dict[str, Any]) -> None:
    if tracked.optimizer is not None:
        for live, saved in zip(tracked.optimizer.param_groups, state["param_groups"], strict=True):
            live.update(saved)
    if tracked.scheduler is not None and state["scheduler"] is not None:
        tracked.scheduler.load_state_dict(state["scheduler"])
    for name, obj in tracked.extra.items():
        if name in state["extra"]:
            obj.load_state_dict(state["extra"][name])
    restore_rng_state(state["rng"])


def _made_like(param: torch.Tensor, saved: torch.Tensor, entry: Entry) -> torch.Tensor:
    device = torch.device("cpu") if entry.on_cpu else local_shard(param).device
    local = saved.to(device=device, copy=True)
    if entry.sharded and isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local
