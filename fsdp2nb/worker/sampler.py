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
        busy = self._is_busy()
        self._rss_peak = max(self._rss_peak, rss)
        return RankSnapshot(
            rank=self._rank, time=time.time(), busy=busy,
            rss_bytes=rss, cpu_percent=self._process.cpu_percent(), rss_peak_bytes=self._rss_peak,
            checkpoint=_checkpoint_view() if self._rank == 0 else None, **_device_memory(self._device),
            **self._tracked_sizes.read(busy), metrics=process_metrics().drain(),
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
    training thread needs, so while a cell runs a sample does no per-parameter work: sizes are
    read when the tracked model changes and once after each cell (which may have changed its
    parameters), the optimizer state also when it gains entries (the first step). A gradient's
    shard is its parameter's (FSDP2 shards them alike), and gradients come and go together
    (backward, `zero_grad`), so one trainable parameter tells whether they are there."""

    def __init__(self) -> None:
        self._model = None
        self._param_bytes = 0
        self._trainable_bytes = 0
        self._probe = None  # the first trainable parameter
        self._optimizer_bytes = 0
        self._num_states = 0
        self._was_busy = True  # the first idle sample reads everything

    def read(self, busy: bool = False) -> dict[str, int]:
        tracked = getattr(current_checkpointer(), "_tracked", None)
        if tracked is None:
            self._model = None
            return {}
        cell_ended, self._was_busy = self._was_busy and not busy, busy
        if tracked.model is not self._model or cell_ended:
            self._read_parameters(tracked.model)
            self._num_states = -1
        num_states = len(tracked.optimizer.state) if tracked.optimizer is not None else 0
        if num_states != self._num_states:  # the first step creates the state: read it at once
            self._num_states = num_states
            self._optimizer_bytes = _optimizer_bytes(tracked.optimizer)
        has_grads = self._probe is not None and self._probe.grad is not None
        return dict(param_bytes=self._param_bytes, grad_bytes=self._trainable_bytes if has_grads else 0,
                    optimizer_bytes=self._optimizer_bytes)

    def _read_parameters(self, model) -> None:  # noqa: ANN001 - a torch module
        self._model = model
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        self._param_bytes = _local_bytes(params)
        self._trainable_bytes = _local_bytes(trainable)
        self._probe = trainable[0] if trainable else None


def _optimizer_bytes(optimizer) -> int:  # noqa: ANN001 - a torch optimizer or None
    states = list(optimizer.state.values()) if optimizer is not None else []
    return _local_bytes([v for state in states for v in state.values() if hasattr(v, "element_size")])


def _local_bytes(tensors: list) -> int:
    """Bytes this rank holds: a DTensor counts its local shard, not the whole tensor."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)
