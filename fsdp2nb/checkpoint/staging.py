"""Staging for async saves: copy shards off the live tensors before training changes them.

The copy runs on a background thread and `save()` returns at once: the next forward and
backward only read parameters and optimizer state, so they overlap the copy, and the optimizer
step, the first thing that writes them, waits for it (`Checkpointer` gates it with a step
pre-hook).

The copy goes into host buffers kept from one save to the next: allocating (and page-faulting)
fresh memory every save costs several times the copy itself. The DTensor wrapping a buffer is kept
too: rebuilding ~200 of them costs as much as the copy on a small model. A buffer is reused only
after the save that used it has finished, which `Checkpointer.save` guarantees by waiting first.
GPU tensors are copied into pinned buffers on a side stream of their GPU that first waits for the
work queued before the save (host_copy.py), so the copy overlaps the next forward and backward. (DCP's DefaultStager deep-
copies the whole state dict instead, and in torch 2.11 fails on a state holding a class object.)

A copy can fail on one rank alone (out of memory). Raising there would leave the other ranks
waiting in the save's collectives for a rank that never joins them. Instead the failed copy
becomes a state that says why, and `StagedSavePlanner` raises on it while DCP agrees on the
plan: DCP then fails the save on every rank, naming this one.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from fsdp2nb.checkpoint.faults import fault_point
from fsdp2nb.checkpoint.host_copy import DeviceToHostCopier, QueuedWork, queued_work_on_current_device
from fsdp2nb.collectives import describe, get_rank
from fsdp2nb.errors import Fsdp2nbError

STAGING_FAILED_KEY = "fsdp2nb_staging_failed"
"""The only key of the state a failed copy stages; its value says why."""


class ReusedBufferStager(AsyncStager):
    """Copies state into host buffers cached by key path (pinned for GPU tensors); DTensors keep
    their mesh and placements."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._wrappers: dict[str, DTensor] = {}
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="fsdp2nb-stage")
        self._gpu = DeviceToHostCopier()

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        ready = queued_work_on_current_device()  # what was queued before save() (the last step) lands first
        return self._copier.submit(self._copy_all, state_dict, ready)

    def _copy_all(self, state_dict: dict[str, Any], ready: QueuedWork | None) -> dict[str, Any]:
        try:
            fault_point("stage_copy", get_rank())
            return self._gpu.run(ready, lambda: self._copy(state_dict, ""))
        except Exception as exc:  # fails the save on every rank through StagedSavePlanner
            return {STAGING_FAILED_KEY: f"rank {get_rank()}: copying the state failed: {describe(exc)}"}

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        self._buffers.clear()
        self._wrappers.clear()

    def _copy(self, obj: Any, path: str) -> Any:
        if isinstance(obj, DTensor):
            return self._dtensor(path, obj)
        if isinstance(obj, torch.Tensor):
            return self._buffer(path, obj)
        if isinstance(obj, dict):
            return {key: self._copy(value, f"{path}/{key}") for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(value, f"{path}/{i}") for i, value in enumerate(obj))
        return copy.deepcopy(obj)

    def _dtensor(self, path: str, source: DTensor) -> DTensor:
        buffer = self._buffer(path, source.to_local())
        cached = self._wrappers.get(path)
        if (cached is not None and cached.to_local().data_ptr() == buffer.data_ptr()
                and cached.device_mesh == source.device_mesh and cached.placements == source.placements
                and cached.shape == source.shape and cached.stride() == source.stride()):
            return cached
        wrapper = DTensor.from_local(buffer, source.device_mesh, source.placements,
                                     run_check=False, shape=source.shape, stride=source.stride())
        self._wrappers[path] = wrapper
        return wrapper

    def _buffer(self, path: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        pinned = source.is_cuda  # pinned host memory lets the copy run without blocking the stream
        if (buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype
                or (pinned and not buffer.is_pinned())):
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
            self._buffers[path] = buffer
        return buffer.copy_(source.detach(), non_blocking=pinned)


class StagingFailed(Fsdp2nbError, RuntimeError):
    """This rank could not copy its state for an async save; DCP reports it to every rank."""


class StagedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that raises, inside DCP's agreement on the plan, on a rank
    whose copy failed: every rank's save then fails alike and none waits in a collective."""

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        failure = state_dict.get(STAGING_FAILED_KEY)
        if failure is not None:
            raise StagingFailed(failure)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def make_stager() -> AsyncStager:
    """The stager of async saves: reused host buffers, pinned for GPU tensors."""
    return ReusedBufferStager()

