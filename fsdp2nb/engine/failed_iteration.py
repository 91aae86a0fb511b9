"""Put FSDP2 modules back in order after a forward or backward that an exception cut short.

A failed forward can leave blocks unsharded (their all-gather done, their reshard never run) and
a failed backward half-reduced gradients; the next iteration would then fail, leak, or add the
failed step's gradients to its own. FSDP2's `reset_iter_state()` reshards every block of a root
and clears its per-iteration state; it waits for the all-gather in flight, which fails at once
when the collective was released. It leaves the gradients that units reduced before the failure:
after a backward cut short, every gradient of the root is dropped (set to None), as FSDP2 treats
a failed iteration as lost, gradient accumulation included.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from fsdp2nb.engine import fsdp_internals


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
            if isinstance(submodule, FSDPModule) and fsdp_internals.is_root(submodule):
                yield submodule


def _reset(root: FSDPModule) -> None:
    cut_short_in_backward = fsdp_internals.backward_cut_short(root)
    try:
        root.reset_iter_state()
    except Exception:  # the all-gather it waits for was released: drop it and reset the rest
        fsdp_internals.drop_all_gathers_in_flight(root)
        root.reset_iter_state()
    if cut_short_in_backward:
        _drop_gradients(root)


def _drop_gradients(root: FSDPModule) -> None:
    """Every gradient of `root` dropped: the units whose reduce-scatter finished before the failure
    hold part of the failed step's gradient, which the next backward would add to."""
    for param in root.parameters():
        param.grad = None
