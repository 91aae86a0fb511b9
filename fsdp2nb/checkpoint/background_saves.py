"""The thread that finishes a Checkpointer's async saves, and what a failed one leaves behind.

An async save hands its last part (wait for the shards, write the rank's file, agree, commit) to
one thread of this process, which talks over its own gloo group: the calling thread's collectives
never interleave with it, and a cell's failure, which re-forms the calling thread's groups, leaves
this one alone (`in_flight.mark_background_group`). A save that fails there is kept until a call
raises it (`save`, `wait`, `maybe_save`) or, failing that, posted for the end of the next cell to
say; the dashboard reads its text meanwhile. A collective that timed out on the group leaves its
connections closed for good, so the next save asks for a fresh group first.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from fsdp2nb import collectives
from fsdp2nb.checkpoint import in_flight
from fsdp2nb.checkpoint.requests import process_failures
from fsdp2nb.errors import CheckpointSaveError, forget_locals

FinishSave = Callable[[dist.ProcessGroup | None], None]
"""The last part of a save, run on the save thread over the group it is given."""


class BackgroundSaves:
    """The save in flight, its thread and group, and the error the last one ended with."""

    def __init__(self, distributed: bool) -> None:
        self.group = collectives.new_gloo_group() if distributed else None
        """The save thread's group (None without a process group)."""
        if self.group is not None:
            in_flight.mark_background_group(self.group)
        self.failed_since_group = False
        """Whether a background save failed since the group was made: a collective that timed out
        there leaves gloo's connections closed for good."""
        self._lock = threading.Lock()
        self._pending: tuple[int, Future] | None = None
        self._error: BaseException | None = None
        self._last_error_text: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2nb-ckpt")

    def start(self, step: int, finish: FinishSave) -> None:
        """Run `finish` for the save of `step` on the save thread."""
        future = self._executor.submit(self._finish, step, finish)
        with self._lock:
            self._pending = (step, future)

    def _finish(self, step: int, finish: FinishSave) -> None:
        """A failure is posted for the end of the next cell to say, unless a call that raises it
        (`save`, `wait`) comes first."""
        try:
            finish(self.group)
        except BaseException as error:
            self.failed_since_group = True
            process_failures().post(f"the background save of step {step} failed: {error}")
            forget_locals(error)  # it is kept until a cell raises it: not its staged tensors and group
            raise

    def wait(self) -> None:
        """Until the save in flight (if any) has ended; its error stays to be raised."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending[1].exception()  # waits without raising

    def saving_step(self) -> int | None:
        self._collect()
        with self._lock:
            return self._pending[0] if self._pending is not None else None

    @property
    def last_error_text(self) -> str | None:
        """The last failure, for the dashboard: kept after it was raised."""
        with self._lock:
            return self._last_error_text

    def has_error(self) -> bool:
        self._collect()
        with self._lock:
            return self._error is not None

    def raise_error(self) -> None:
        """Raise (once) the error a background save ended with."""
        self._collect()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            process_failures().take()  # said by this error
            raise CheckpointSaveError(f"an earlier background save failed: {error}") from error

    def _collect(self) -> None:
        """Move a finished save's outcome into the error slot."""
        with self._lock:
            if self._pending is None or not self._pending[1].done():
                return
            step, future = self._pending
            self._pending = None
            exc = future.exception()
            if exc is not None:
                self._error = exc
                self._last_error_text = f"step {step}: {exc}"

    def renew_group(self) -> None:
        """Fresh connections after a failed save; every rank calls it once the ranks agreed, with
        no save in flight."""
        if self.group is None:
            return
        old, self.group = self.group, collectives.new_gloo_group()
        in_flight.mark_background_group(self.group)
        dist.destroy_process_group(old)
        del old
        gc.collect()  # the failed save's work objects hold its connections in reference cycles
        self.failed_since_group = False

    def close(self) -> None:
        """Stop the thread (after the save in flight); safe to call twice."""
        self._executor.shutdown(wait=True)

    def destroy_group(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
