"""What a rank says when a cell fails to allocate memory: the size asked for, what was free,
and what the rank held by category (`MemoryShortage`, carried by the cell's `ErrorInfo`).

Read on the rank's main thread as the error is reported, when no user code runs, so the
model's tensors may be read (the sampler thread must never read them).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from fsdp2nb.wire.records import MemoryShortage

logger = logging.getLogger(__name__)

_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60}
_REQUESTED = (
    re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE),  # the CPU allocator's
    re.compile(r"(?:tried|unable) to allocate ([\d.]+) ?(B|KiB|MiB|GiB|TiB|PiB|EiB)\b", re.IGNORECASE),  # CUDA's, numpy's
)
_CPU_ALLOCATOR_FAILED = "can't allocate memory"
"""In the CPU allocator's RuntimeError: the only sign of what it is (torch raises no type of its own)."""


def shortage_of(error: BaseException) -> MemoryShortage | None:
    """The memory report for `error` if it (or an error it was raised from) is a failed allocation."""
    failed = _failed_allocation(error)
    if failed is None:
        return None
    try:
        return _shortage(failed)
    except Exception:  # the cell's own error must reach the notebook whatever happens here
        logger.exception("reading what the rank held after a failed allocation failed")
        return None


def _shortage(failed: BaseException) -> MemoryShortage:
    device = _cuda_device() if _is_cuda_oom(failed) else "cpu"
    free, capacity, used = _cuda_memory(device) if device != "cpu" else _host_memory()
    sizes = tracked_bytes()
    return MemoryShortage(device=device, requested_bytes=requested_bytes(str(failed)), free_bytes=free,
                          capacity_bytes=capacity, used_bytes=used, tracked=sizes is not None,
                          **(sizes or {}))


def requested_bytes(message: str) -> int | None:
    """The size an allocator's message says was asked for."""
    for pattern in _REQUESTED:
        match = pattern.search(message)
        if match:
            unit = match.group(2).lower() if match.lastindex == 2 else "b"
            return int(float(match.group(1)) * _UNITS[unit])
    return None


def _failed_allocation(error: BaseException) -> BaseException | None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, MemoryError) or _is_cuda_oom(error) or (
                isinstance(error, RuntimeError) and _CPU_ALLOCATOR_FAILED in str(error)):
            return error
        error = error.__cause__ or error.__context__
    return None


def _is_cuda_oom(error: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _cuda_device() -> str:
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def _cuda_memory(device: str) -> tuple[int | None, int | None, int]:
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_allocated(device)


def _host_memory() -> tuple[int | None, int | None, int]:
    import psutil

    from fsdp2nb.host_memory import available_bytes, host_limit_bytes

    return available_bytes(), host_limit_bytes(), psutil.Process().memory_info().rss


def tracked_bytes() -> dict[str, int] | None:
    """Bytes of this rank's model's parameters, gradients and optimizer state, read now (after a
    failed backward only some gradients exist); None when the rank knows no model.

    The model is the one a Checkpointer tracks, with its optimizer; else the one `load_model`
    returned last, with the optimizers that have stepped over it."""
    from fsdp2nb.worker.sampler import held_bytes

    known = _known_model()
    if known is None:
        return None
    model, optimizers = known
    params = list(model.parameters())
    states = [state for optimizer in optimizers for state in optimizer.state.values()]
    return dict(param_bytes=held_bytes(params), grad_bytes=held_bytes([p.grad for p in params]),
                optimizer_bytes=held_bytes([value for state in states for value in state.values()]))


def _known_model() -> tuple[Any, list[Any]] | None:  # (a torch module, its torch optimizers)
    from fsdp2nb.checkpoint.tracking import current_checkpointer

    tracked = getattr(current_checkpointer(), "_tracked", None)
    if tracked is not None:
        return tracked.model, [tracked.optimizer] if tracked.optimizer is not None else []
    loaded = sys.modules.get("fsdp2nb.engine.loaded_model")  # not imported: no model was loaded
    model = loaded.last_loaded_model() if loaded is not None else None
    return (model, loaded.optimizers_of(model)) if model is not None else None
