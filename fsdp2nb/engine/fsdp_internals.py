"""The parts of FSDP2 (and of `nn.Module`) that torch keeps private and fsdp2nb still needs, in one
place: nothing else in the package names them.

FSDP2 has no public way to read a unit's mixed-precision policy or its reshard-after-forward
setting, to tell a backward cut short from a forward, or to take its forward hooks out of a pass
on gathered weights. Each of those reads an attribute of torch 2.13's `FSDPState` or
`FSDPParamGroup`; should a later torch rename one, `attribute` raises `TorchInternalsChanged`
naming it, rather than the caller going on with a default. `check_internals` touches every one
of them on a real unit: tests/distributed/test_fsdp_internals.py runs it, and pyproject.toml
bounds torch to the releases it passed on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp2nb.errors import NotSupported

FORWARD_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
"""Where `nn.Module` keeps a module's forward hooks by id; FSDP2 registers its own there."""


class TorchInternalsChanged(NotSupported):
    """This torch lacks a private FSDP2 attribute fsdp2nb reads: a release it was not tested on."""


def attribute(owner: object, name: str) -> Any:
    """`owner.name`, or TorchInternalsChanged naming what is missing and the torch in use."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise TorchInternalsChanged(
            f"torch {torch.__version__}: FSDP2's {type(owner).__name__} has no {name!r}; install the torch "
            "that pyproject.toml names (fsdp2nb reads this private attribute)") from None


def fsdp_state(unit: FSDPModule) -> Any:
    return attribute(unit, "_get_fsdp_state")()


def is_root(unit: FSDPModule) -> bool:
    """Whether `unit` is the root of a tree that ran a forward (FSDP2 decides roots then)."""
    return attribute(fsdp_state(unit), "_is_root") is True


def param_groups(state: Any) -> list:
    """An FSDP2 state's parameter groups (a unit without parameters has none)."""
    return list(attribute(state, "_fsdp_param_groups"))


def gather_dtype(unit: FSDPModule) -> torch.dtype | None:
    """The dtype `unit`'s MixedPrecisionPolicy gathers parameters in; None where they keep their own."""
    return attribute(attribute(fsdp_state(unit), "_mp_policy"), "param_dtype")


def states_under(root: FSDPModule) -> list:
    """The FSDP2 states of every unit of `root`'s tree (filled in by the root's first forward)."""
    return list(attribute(attribute(fsdp_state(root), "_state_ctx"), "all_states"))


def backward_cut_short(root: FSDPModule) -> bool:
    """Whether a backward through `root` began and did not finish: FSDP2 queues its end-of-backward
    callback when backward reaches the root, and the callback clears the flag."""
    return bool(attribute(attribute(fsdp_state(root), "_state_ctx"), "post_backward_final_callback_queued"))


def drop_all_gathers_in_flight(root: FSDPModule) -> None:
    """Forget the all-gathers of every unit of `root` (for when their collective was released)."""
    for state in states_under(root):
        for group in param_groups(state):
            attribute(group, "_all_gather_result")
            group._all_gather_result = None


def reshard_settings(unit: FSDPModule) -> tuple:
    """`unit`'s reshard-after-forward setting exactly as FSDP2 keeps it (a root's automatic False,
    resharding to a smaller group), not as the nearest bool: FSDP2 offers a setter only."""
    state = fsdp_state(unit)
    return (attribute(state, "_auto_reshard_after_forward"),
            [attribute(group, "post_forward_mesh_info") for group in param_groups(state)])


def restore_reshard_settings(unit: FSDPModule, settings: tuple) -> None:
    state = fsdp_state(unit)
    auto, mesh_infos = settings
    state._auto_reshard_after_forward = auto
    for group, mesh_info in zip(param_groups(state), mesh_infos, strict=True):
        group.post_forward_mesh_info = mesh_info


def forward_hook_ids(unit: FSDPModule) -> set[int]:
    """The ids of FSDP2's own forward hooks on `unit`, as keys of the modules' hook tables."""
    state = fsdp_state(unit)
    ids: set[int] = set()
    for handle in (attribute(state, "_pre_forward_hook_handle"), attribute(state, "_post_forward_hook_handle")):
        for entry in getattr(handle, "handles", (handle,)):  # a grouped unit's handle holds one per module
            ids.add(attribute(entry, "id"))
    return ids


@contextlib.contextmanager
def forward_hooks_removed(model: nn.Module, hook_ids: set[int]) -> Iterator[None]:
    """The forward hooks with these ids left out of every module of `model` until exit; then each
    hook table as it was, in its order."""
    saved = []
    for module in model.modules():
        for name in FORWARD_HOOK_TABLES:
            table = attribute(module, name)
            if not hook_ids.isdisjoint(table):
                saved.append((table, list(table.items())))
                for hook_id in hook_ids.intersection(table):
                    del table[hook_id]
    try:
        yield
    finally:
        for table, items in saved:
            table.clear()
            table.update(items)


def check_internals(unit: FSDPModule) -> None:
    """Read every private attribute this module uses on `unit`, a root that ran a forward; raises
    TorchInternalsChanged naming the first one this torch lacks."""
    state = fsdp_state(unit)
    is_root(unit)
    gather_dtype(unit)
    backward_cut_short(unit)
    for each in states_under(unit):
        for group in param_groups(each):
            attribute(group, "_all_gather_result")
    reshard_settings(unit)
    forward_hook_ids(unit)
    for name in FORWARD_HOOK_TABLES:
        attribute(unit, name)
    attribute(state, "_state_ctx")
