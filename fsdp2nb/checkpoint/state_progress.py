"""Where the checkpoint code reports its progress (fsdp2nb.progress): totals and a DCP load planner."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from fsdp2nb import progress


def local_state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict that this rank holds: a DTensor's local shard."""
    if isinstance(state, dict):
        return sum(local_state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_state_bytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def start_state_task(kind: str, label: str, state: dict[str, Any]) -> progress.AnyTask:
    """A task sized by `state`'s local bytes; the state is walked only when someone listens."""
    if not progress.listening():
        return progress.SILENT
    return progress.start_task(kind, label, total_bytes=local_state_bytes(state))


class ProgressLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, advancing `task` by each tensor (or slice) it has read."""

    def __init__(self, task: progress.AnyTask) -> None:
        super().__init__()
        self._task = task

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        self._task.set_totals(total_items=len(plan.items))
        return plan

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self._task.advance(tensor.numel() * tensor.element_size(), 1)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        super().load_bytes(read_item, value)
        self._task.advance(0, 1)
