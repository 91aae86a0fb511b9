"""A thread in each rank that reports its memory and CPU use about twice a second.

The rank's main thread also sends one snapshot at the end of a request that changed what a
snapshot tells (`flush`), before its reply: what the cell logged, and the checkpointer it began
tracking, are then in the kernel when the cell returns, not half a second later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psutil

from fsdp2nb.checkpoint.tracking import current_checkpointer
from fsdp2nb.checkpoint.trainer_dirs import published as published_trainer_checkpoints
from fsdp2nb.metrics import process_metrics
from fsdp2nb.wire.events import RankSnapshot
from fsdp2nb.wire.records import CheckpointStatus, CheckpointView

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.5
STEP_REFRESH_INTERVAL_S = 2.0
"""How often, at most, an optimizer step reads the tracked model's sizes again during a cell."""


class ResourceSampler:
    """Sends a RankSnapshot every `interval_s` until stopped; `stop()` is safe to call twice."""

    def __init__(self, rank: int, device: str, send: Callable[[RankSnapshot], None],
                 is_busy: Callable[[], bool], interval_s: float = SAMPLE_INTERVAL_S,
                 step_refresh_interval_s: float = STEP_REFRESH_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rank = rank
        self._device = device
        self._send = send
        self._is_busy = is_busy
        self._interval_s = interval_s
        self._process = psutil.Process()
        self._stopped = threading.Event()
        self._send_lock = threading.Lock()
        """Held while a snapshot is taken and sent: a flush that finds nothing pending knows that
        no points drained by the sampler's thread are still on their way behind it."""
        self._reported: tuple[object, object] = (None, None)
        """Rank 0: the tracked checkpointer and the Trainer listing that the last snapshot carried."""
        self._flush_failed = False
        self._rss_peak = 0
        self._tracked_sizes = TrackedSizes()
        self._tracked_sizes_failed = False
        self._step_refresh_interval_s = step_refresh_interval_s
        self._clock = clock
        self._next_step_refresh = float("-inf")
        self._step_hook = None  # the handle of the optimizer step hook, while one is registered
        self._thread = threading.Thread(target=self._run, daemon=True, name="fsdp2nb-sampler")

    def start(self) -> None:
        self._process.cpu_percent()  # the first reading only sets the baseline
        self.watch_optimizer_steps()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def watch_optimizer_steps(self) -> None:
        """Read the tracked sizes after an optimizer step too, so that a training cell's panel
        shows gradients and optimizer state from its first step, not from the cell's end.

        torch's global step hook sees every optimizer. It runs on the thread that stepped, which is
        the one training, so reading the tensors there is safe (see TrackedSizes); the sampler's
        thread never does. At most one step per `step_refresh_interval_s` reads them."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._step_hook is None:
            self._step_hook = register_optimizer_step_post_hook(self._after_optimizer_step)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:  # torch's hook signature
        now = self._clock()
        if now < self._next_step_refresh:
            return
        self._next_step_refresh = now + self._step_refresh_interval_s
        self.refresh_tracked_sizes()

    def refresh_tracked_sizes(self) -> None:
        """Read the tracked model's sizes (see TrackedSizes); the rank calls it between requests."""
        try:
            self._tracked_sizes.refresh()
        except Exception:  # a failed reading must never take the rank down; say why once
            if not self._tracked_sizes_failed:
                logger.exception("rank %d: reading the tracked model's sizes failed (later failures are not logged)",
                                 self._rank)
            self._tracked_sizes_failed = True

    def flush(self) -> None:
        """Send a snapshot now if the request that just ended changed what one tells: points
        logged with `fsdp2nb.log`, or (rank 0) which checkpointer is tracked or the Trainer listing.
        The rank calls it before its reply, on its main thread; it never raises."""
        try:
            with self._send_lock:
                if process_metrics().pending() or self._tracking() != self._reported:
                    self._send(self.sample())
        except Exception:  # the reply must go out whatever this did; say why once
            if not self._flush_failed:
                logger.exception("rank %d: sending the request's snapshot failed (later failures are not logged)",
                                 self._rank)
            self._flush_failed = True

    def _tracking(self) -> tuple[object, object]:
        """What rank 0's snapshots report of checkpoints: the tracked checkpointer, the Trainer's listing."""
        if self._rank != 0:
            return (None, None)
        return (current_checkpointer(), published_trainer_checkpoints())

    def reset_peak(self) -> None:
        """Start the peak readings afresh (RSS here, the CUDA allocator's peak on a GPU rank)."""
        self._rss_peak = 0
        if self._device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(int(self._device.split(":")[1]))

    def sample(self) -> RankSnapshot:
        self._reported = self._tracking()  # read first: a change while sampling is sent again
        rss = self._process.memory_info().rss
        busy = self._is_busy()
        self._rss_peak = max(self._rss_peak, rss)
        return RankSnapshot(
            rank=self._rank, time=time.time(), busy=busy,
            rss_bytes=rss, cpu_percent=self._process.cpu_percent(), rss_peak_bytes=self._rss_peak,
            checkpoint=_checkpoint_view() if self._rank == 0 else None, **_device_memory(self._device),
            **self._tracked_sizes.read(), metrics=process_metrics().drain(),
            trainer_checkpoints=_trainer_checkpoint_view() if self._rank == 0 else None,
        )

    def _run(self) -> None:
        failed_before = False
        while True:
            try:
                with self._send_lock:
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
    return _with_requests(tracked.status)


def _trainer_checkpoint_view() -> CheckpointView | None:
    """The `checkpoint-N` listing a TrainerCallback published last, if one did."""
    if published_trainer_checkpoints() is None:
        return None
    return _with_requests(published_trainer_checkpoints)


def _with_requests(status: Callable[[], CheckpointStatus | None]) -> CheckpointView:
    from fsdp2nb.checkpoint.requests import process_requests

    requests = process_requests().outcome()  # read first: a save committed for it is in the listing
    return CheckpointView(status=status(), requests_served=requests.served, request_step=requests.step,
                          requests_committed=requests.committed, request_error=requests.error)


class TrackedSizes:
    """Bytes of the tracked model's parameters, gradients and optimizer state on this rank.

    `refresh()` reads them on the rank's main thread, between requests and after an optimizer
    step (at most every few seconds); `read()`, called by the sampler thread, only hands out the
    last reading. The sampler must not touch the tensors: a
    thread that reads `param.grad` while the main thread trains an FSDP2 model (FSDP2 assigns
    each step's sharded gradients, `zero_grad` drops them) corrupts CPython's object heap now
    and then, and the rank dies of SIGSEGV later, somewhere else (seen with torch 2.13 on Python
    3.11; `scripts/repro_grad_read_race.py` reproduces it). So the figures are those of the
    last step read or the end of the last cell, not of the moment. A gradient's shard is its parameter's (FSDP2
    shards them alike), and gradients come and go together (backward, `zero_grad`), so one
    trainable parameter tells whether they are there."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self._model = None
        self._parameters_key: list = []  # (parameter, requires_grad) as last read
        self._param_bytes = 0
        self._trainable_bytes = 0
        self._probe = None  # the first trainable parameter
        self._optimizer_bytes = 0
        self._num_states = -1

    def read(self) -> dict[str, int]:
        """The last reading; safe on any thread (it is replaced whole, never changed)."""
        return self._sizes

    def refresh(self) -> None:
        """Read the sizes again; on the thread that trains, between its steps (or between cells)."""
        tracked = getattr(current_checkpointer(), "_tracked", None)
        if tracked is None:
            self._model, self._probe, self._parameters_key, self._sizes = None, None, [], {}
            return
        self._read_parameters(tracked.model)  # a cell may have changed them (LoRA adapters, say)
        num_states = len(tracked.optimizer.state) if tracked.optimizer is not None else 0
        if num_states != self._num_states:  # the first step creates the state
            self._num_states = num_states
            self._optimizer_bytes = optimizer_bytes(tracked.optimizer)
        has_grads = self._probe is not None and self._probe.grad is not None
        self._sizes = dict(param_bytes=self._param_bytes, grad_bytes=self._trainable_bytes if has_grads else 0,
                           optimizer_bytes=self._optimizer_bytes)

    def _read_parameters(self, model) -> None:  # a torch module
        if model is not self._model:
            self._num_states = -1
        params = list(model.parameters())
        # The same parameter objects hold the same shards (sharding anew makes new parameters), so
        # each shard's size is read again only when the parameters or what trains have changed.
        key = [(p, p.requires_grad) for p in params]
        if model is self._model and _same_parameters(key, self._parameters_key):
            return
        self._model, self._parameters_key = model, key
        trainable = [p for p in params if p.requires_grad]
        self._param_bytes = held_bytes(params)
        self._trainable_bytes = held_bytes(trainable)
        self._probe = trainable[0] if trainable else None


def _same_parameters(now: list, before: list) -> bool:
    """Whether two (parameter, requires_grad) lists name the same objects, training alike."""
    return len(now) == len(before) and all(
        p is q and trains == trained for (p, trains), (q, trained) in zip(now, before, strict=True))


def optimizer_bytes(optimizer) -> int:  # a torch optimizer or None
    states = list(optimizer.state.values()) if optimizer is not None else []
    return held_bytes([v for state in states for v in state.values()])


def held_bytes(tensors: list) -> int:
    """Bytes of the storages behind `tensors`, each counted once: what this rank holds for them.

    A DTensor counts its local shard's storage, which FSDP2 pads to the first rank's chunk;
    FSDP2's gradients are views into one buffer per unit, counted once."""
    storages = {}
    for tensor in tensors:
        if tensor is None or not hasattr(tensor, "untyped_storage"):
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        storages[id(storage)] = storage  # held here, so no id is reused while counting
    return sum(storage.nbytes() for storage in storages.values())
