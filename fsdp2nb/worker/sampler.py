"""A thread in each rank that reports its memory and CPU use about twice a second."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psutil

from fsdp2nb.checkpoint.tracking import current_checkpointer
from fsdp2nb.wire.protocol import CheckpointStep, CheckpointView, RankSnapshot
from fsdp2nb.worker.metrics import process_metrics

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.5


class ResourceSampler:
    """Sends a RankSnapshot every `interval_s` until stopped; `stop()` is safe to call twice."""

    def __init__(self, rank: int, device: str, send: Callable[[RankSnapshot], None],
                 is_busy: Callable[[], bool], interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._rank = rank
        self._device = device
        self._send = send
        self._is_busy = is_busy
        self._interval_s = interval_s
        self._process = psutil.Process()
        self._stopped = threading.Event()
        self._rss_peak = 0
        self._tracked_sizes = TrackedSizes()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fsdp2nb-sampler")

    def start(self) -> None:
        self._process.cpu_percent()  # the first reading only sets the baseline
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def reset_peak(self) -> None:
        """Start the peak readings afresh (RSS here, the CUDA allocator's peak on a GPU rank)."""
        self._rss_peak = 0
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(int(self._device.split(":")[1]))

    def sample(self) -> RankSnapshot:
        rss = self._process.memory_info().rss
        self._rss_peak = max(self._rss_peak, rss)
        return RankSnapshot(
            rank=self._rank, time=time.time(), busy=self._is_busy(),
            rss_bytes=rss, cpu_percent=self._process.cpu_percent(), rss_peak_bytes=self._rss_peak,
            checkpoint=_checkpoint_view() if self._rank == 0 else None, **_device_memory(self._device),
            **self._tracked_sizes.read(), metrics=process_metrics().drain(),
        )

    def _run(self) -> None:
        failed_before = False
        while True:
            try:
                self._send(self.sample())
            except Exception:  # a failed reading must never take the rank down; say why once
                if not failed_before:
                    logger.exception("rank %d: a resource reading failed (later failures are not logged)",
                                     self._rank)
                failed_before = True
            if self._stopped.wait(self._interval_s):
                return


def _device_memory(device: str) -> dict[str, int]:
    if not device.startswith("cuda"):
        return {}
    import torch

    index = int(device.split(":")[1])
    return dict(
        device_allocated_bytes=torch.cuda.memory_allocated(index),
        device_reserved_bytes=torch.cuda.memory_reserved(index),
        device_peak_bytes=torch.cuda.max_memory_allocated(index),
        device_total_bytes=torch.cuda.get_device_properties(index).total_memory,
    )


def _checkpoint_view() -> CheckpointView | None:
    """The tracked checkpointer's status, if this rank has one."""
    tracked = current_checkpointer()
    if tracked is None:
        return None
    status = tracked.status()
    from fsdp2nb.checkpoint.requests import process_requests

    entries = tuple(CheckpointStep(step=e.step, wall_time=e.wall_time, size_bytes=e.size_bytes,
                                   world_size=e.world_size, valid=e.valid) for e in status.entries)
    return CheckpointView(directory=status.directory, latest_step=status.latest_step,
                          saving_step=status.saving_step, last_error=status.last_error,
                          steps=tuple(entry.step for entry in status.entries if entry.valid),
                          blocked_s=status.blocked_s, entries=entries,
                          requests_served=process_requests().served())


class TrackedSizes:
    """Bytes of the tracked model's parameters, gradients and optimizer state on this rank.

    Reading a DTensor's local shard goes through an autograd function, holding the GIL the
    training thread needs, so each parameter's local size is read once per model, and the
    optimizer state when it gains entries (the first step) and every `refresh_every` samples.
    A gradient's shard is its parameter's (FSDP2 shards them alike): one attribute read each."""

    def __init__(self, refresh_every: int = 20) -> None:
        self._refresh_every = refresh_every
        self._model = None
        self._params: list[tuple[object, int]] = []
        self._optimizer_bytes = 0
        self._num_states = 0
        self._samples = 0

    def read(self) -> dict[str, int]:
        tracked = getattr(current_checkpointer(), "_tracked", None)
        if tracked is None:
            return {}
        num_states = len(tracked.optimizer.state) if tracked.optimizer is not None else 0
        if tracked.model is not self._model or self._samples % self._refresh_every == 0:
            self._model = tracked.model
            self._params = [(p, _local_bytes([p])) for p in tracked.model.parameters()]
            self._num_states = -1
        if num_states != self._num_states:  # the first step creates the state: read it at once
            self._num_states = num_states
            self._optimizer_bytes = _optimizer_bytes(tracked.optimizer)
        self._samples += 1
        return dict(param_bytes=sum(size for _, size in self._params),
                    grad_bytes=sum(size for p, size in self._params if p.grad is not None),
                    optimizer_bytes=self._optimizer_bytes)


def _optimizer_bytes(optimizer) -> int:  # noqa: ANN001 - a torch optimizer or None
    states = list(optimizer.state.values()) if optimizer is not None else []
    return _local_bytes([v for state in states for v in state.values() if hasattr(v, "element_size")])


def _local_bytes(tensors: list) -> int:
    """Bytes this rank holds: a DTensor counts its local shard, not the whole tensor."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)
