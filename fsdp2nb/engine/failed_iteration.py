"""Put FSDP2 modules back in order after a forward or backward that an exception cut short.

A failed forward can leave blocks unsharded (their all-gather done, their reshard never run) and
a failed backward half-reduced gradients; the next iteration would then fail or leak. FSDP2's
`reset_iter_state()` reshards every block of a root and clears its per-iteration state; it waits
for the all-gather in flight, which fails at once when the collective was released.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def reset_failed_iterations(candidates: Iterable[object]) -> int:
    """Reset every FSDP2 root module found in `candidates` (modules, or objects whose `model`
    attribute is one, such as a Trainer); returns how many roots were reset."""
    roots = {id(root): root for root in _fsdp_roots(candidates)}
    for root in roots.values():
        _reset(root)
    return len(roots)


def _fsdp_roots(candidates: Iterable[object]) -> Iterable[FSDPModule]:
    for candidate in candidates:
        module = candidate if isinstance(candidate, nn.Module) else getattr(candidate, "model", None)
        if not isinstance(module, nn.Module):
            continue
        for submodule in module.modules():
            if isinstance(submodule, FSDPModule) and submodule._get_fsdp_state()._is_root:
                yield submodule


def _reset(root: FSDPModule) -> None:
    try:
        root.reset_iter_state()
    except Exception:  # the all-gather it waits for was released: drop it and reset the rest
        for state in root._get_fsdp_state()._state_ctx.all_states:
            for param_group in param_groups_of(state):
                param_group._all_gather_result = None
        root.reset_iter_state()


def param_groups_of(state) -> list:
    """An FSDP2 state's parameter groups: torch 2.13 keeps a list, earlier releases one or None."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []
