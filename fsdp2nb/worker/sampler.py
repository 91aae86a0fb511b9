"""A thread in each rank that reports its memory and CPU use about twice a second."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psutil

from fsdp2nb.checkpoint.tracking import current_checkpointer
from fsdp2nb.wire.protocol import CheckpointView, RankSnapshot

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
        self._thread = threading.Thread(target=self._run, daemon=True, name="fsdp2nb-sampler")

    def start(self) -> None:
        self._process.cpu_percent()  # the first reading only sets the baseline
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def sample(self) -> RankSnapshot:
        return RankSnapshot(
            rank=self._rank, time=time.time(), busy=self._is_busy(),
            rss_bytes=self._process.memory_info().rss, cpu_percent=self._process.cpu_percent(),
            checkpoint=_checkpoint_view() if self._rank == 0 else None, **_device_memory(self._device),
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
    return CheckpointView(directory=status.directory, latest_step=status.latest_step,
                          saving_step=status.saving_step, last_error=status.last_error,
                          steps=tuple(entry.step for entry in status.entries if entry.valid),
                          blocked_s=status.blocked_s)
