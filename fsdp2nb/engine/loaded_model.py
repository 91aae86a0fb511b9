"""What this rank trains, known without a Checkpointer: the model `load_model` returned last and
the optimizers that have stepped over it. The out-of-memory report splits a rank's memory by them
(`worker/memory_failure.py`).

Both are held weakly: a model or optimizer the notebook drops is freed as it would be without fsdp2nb.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

_last_loaded: weakref.ref[nn.Module] | None = None
_stepped: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_step_hook: RemovableHandle | None = None


def note_loaded(model: nn.Module) -> None:
    """Remember `model` as the one this rank trains; from now on, note every optimizer that steps.

    An optimizer holds state only once it has stepped (Adam makes its moments then), and torch's
    global step hook sees every one wherever the notebook keeps it: a variable, a Trainer, a closure."""
    global _last_loaded, _step_hook
    _last_loaded = weakref.ref(model)
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_note_stepped)


def _note_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # A pre-hook: an allocation that fails inside the first step, making the state, finds it too.
    _stepped.add(optimizer)


def last_loaded_model() -> nn.Module | None:
    """The model `load_model` returned last on this rank, while something else still holds it."""
    return _last_loaded() if _last_loaded is not None else None


def optimizers_of(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers that have stepped over any of `model`'s parameters, and are still held."""
    params = {id(p) for p in model.parameters()}
    return [optimizer for optimizer in list(_stepped)
            if any(id(p) in params for group in optimizer.param_groups for p in group["params"])]
