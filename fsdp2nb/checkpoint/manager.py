"""Checkpointer: atomic, optionally asynchronous checkpoints of a training run, with retention.

A save writes the step in three parts (step_writer.py): the ranks agree on a temporary directory
and copy their shards on the calling thread, a thread writes them, and rank 0 commits once every
rank succeeded. A crash at any point leaves LATEST naming the previous, complete checkpoint.

The Checkpointer holds what the calls share: what it tracks, the last step seen, the optimizer
step that waits for a save's copy, and its two gloo groups (one for the calling thread, one for
the save thread, so a save in flight never interleaves its collectives with `maybe_save`'s or the
training step's). The parts live beside it: writing a step (step_writer), the save thread and
its failures (background_saves), the rank's file (rank_file), the commit (commit), the saves in
flight (in_flight), layout, loadable_steps, direct_writes, staging, state, collectives, and the
steps kept in host memory (memory_steps), which the Checkpointer takes at `maybe_save` and
restores at `track()` and `load()`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from fsdp2nb import collectives
from fsdp2nb.checkpoint import in_flight, layout, tracking
from fsdp2nb.checkpoint.background_saves import BackgroundSaves
from fsdp2nb.checkpoint.config import AsyncWriter, CheckpointerConfig
from fsdp2nb.checkpoint.layout import CheckpointEntry
from fsdp2nb.checkpoint.loadable_steps import LoadableSteps
from fsdp2nb.checkpoint.memory_steps import MemorySteps, snapshot_store
from fsdp2nb.checkpoint.rank_file import (
    Tracked,
    capture_rank_state,
    read_rank_state_collectively,
    restore_rank_state,
)
from fsdp2nb.checkpoint.requests import SaveRequests, process_requests
from fsdp2nb.checkpoint.staging import make_stager
from fsdp2nb.checkpoint.state import (
    checked_training_state,
    read_dcp_metadata,
    set_training_state,
    training_state_to_save,
)
from fsdp2nb.checkpoint.state_progress import ProgressLoadPlanner, start_state_task
from fsdp2nb.checkpoint.step_writer import NOTHING_LOST, StepWriter
from fsdp2nb.checkpoint.tracking import CheckpointStatus
from fsdp2nb.collectives import FailedElsewhere, all_ranks_succeeded, describe
from fsdp2nb.errors import (
    CheckpointSaveError,
    InvalidValue,
    NotReady,
    UsageMistake,
)

logger = logging.getLogger(__name__)


class Checkpointer:
    """Saves and restores model, optimizer, scheduler, RNG and step under `directory`.

    Create it on every rank (it makes two gloo groups). `keep` is how many valid checkpoints to
    retain (None keeps all); `async_save` lets training continue while files are written.
    `async_writer` says where: "thread" (default) writes from a thread of this process; "process"
    serializes and writes in DCP's persistent writer process, off this process's GIL (started by
    the first async save, shared by every checkpointer of the process, running at the lowest CPU
    priority); it pays off where training leaves cores idle (benchmarks/bench_checkpoint.py
    measures both). Without a process group async saves always use a thread.

    `memory_every=N` also copies the state into host memory every N steps of `maybe_save` (see
    memory_snapshots.py), where it outlives the ranks: after a rank dies and the pool restarts,
    running the same set-up again (model, optimizer, `track()` on this directory) restores the
    newest snapshot when it is newer than the newest checkpoint on disk, and says so.

        ckpt = Checkpointer("/ckpt/run1", keep=3)
        ckpt.track(model=model, optimizer=opt, scheduler=sched)
        start = ckpt.load("latest") + 1 if ckpt.latest() is not None else 0
        for step in range(start, num_steps):
            train_step()
            ckpt.maybe_save(step)          # saves when the notebook asked for one
        ckpt.save(num_steps - 1); ckpt.wait()

    With `memory_every`, `track()` may have restored a snapshot already: start from `last_step + 1`.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, async_save: bool = True,
                 *, async_writer: AsyncWriter = "thread", checksums: bool = True, memory_every: int | None = None,
                 requests: SaveRequests | None = None) -> None:
        self.config = CheckpointerConfig(keep=keep, async_save=async_save, async_writer=async_writer,
                                         checksums=checksums, memory_every=memory_every)
        store = snapshot_store(memory_every)
        self.directory = Path(directory).absolute()
        self._requests = requests if requests is not None else process_requests()
        self._distributed = collectives.is_distributed()
        self._rank = collectives.get_rank()
        self._world_size = collectives.get_world_size()
        # Two groups: the calling thread's collectives must never interleave with a background save's.
        self._fg_group = collectives.new_gloo_group() if self._distributed else None
        self._background = BackgroundSaves(self._distributed)
        self._closed = False
        self._check_writable()
        self._tracked: Tracked | None = None
        self._last_step: int | None = None
        self._steps = LoadableSteps(self.directory, checksums=self.config.checksums, rank=self._rank,
                                    world_size=self._world_size, distributed=self._distributed)
        self._writer = StepWriter(self.directory, keep=keep, checksums=checksums, async_writer=async_writer,
                                  rank=self._rank, world_size=self._world_size, distributed=self._distributed,
                                  requests=self._requests, background=self._background)
        self._stager = make_stager() if async_save else None
        self._staging: Future | None = None  # the copy of the save in flight
        self._step_gate = None  # handle of the optimizer step pre-hook that waits for it
        self.blocked_s = 0.0
        """Seconds this rank's training has waited on saves: inside save() and, for an async
        save, in the next optimizer step's wait for the copy. An async save's writing is not
        counted: it overlaps training (and competes with it for CPU where no core is spare)."""
        if self._rank == 0:
            in_flight.sweep(self.directory)
        try:
            self._memory = MemorySteps.open(store, self.directory, self._steps, memory_every, rank=self._rank,
                                            world_size=self._world_size, group=self._fg_group)
        except BaseException:
            self._destroy_groups()
            raise

    # ---- settings ------------------------------------------------------------------------------

    @property
    def keep(self) -> int | None:
        """How many valid checkpoints to retain (None keeps all); see CheckpointerConfig."""
        return self.config.keep

    @property
    def async_save(self) -> bool:
        """Whether saves write in the background; may be changed between saves."""
        return self.config.async_save

    @async_save.setter
    def async_save(self, value: bool) -> None:
        self.config = dataclasses.replace(self.config, async_save=value)

    @property
    def async_writer(self) -> AsyncWriter:
        """Where an async save writes: "thread" or "process"; see CheckpointerConfig."""
        return self.config.async_writer

    # ---- setup -------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        try:
            all_ranks_succeeded(layout.why_unwritable(self.directory, self._rank), "writing a file", self._fg_group)
        except (OSError, FailedElsewhere) as exc:
            self._destroy_groups()
            where = f"on rank {self._rank}: {describe(exc)}" if isinstance(exc, OSError) else f"({exc})"
            raise UsageMistake(f"directory={str(self.directory)!r} is not writable {where}; "
                               "give a directory every rank can write") from None

    def track(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              scheduler: Any = None, **extra_stateful: Any) -> Checkpointer:
        """Name what save/load cover; extra objects need state_dict() and load_state_dict()."""
        for name, obj in {"scheduler": scheduler, **extra_stateful}.items():
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise InvalidValue(f"{name}={type(obj).__name__} has no state_dict/load_state_dict")
        self._tracked = Tracked(model, optimizer, scheduler, dict(extra_stateful))
        tracking.set_tracked(self)
        self._gate_optimizer_step(optimizer)
        restored = self._memory.restore_if_newer(self._tracked)
        if restored is not None:
            self._last_step = restored
        return self

    def _gate_optimizer_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the optimizer's step, the first write to what a save copies, wait for the copy."""
        if self._step_gate is not None:
            self._step_gate.remove()
            self._step_gate = None
        if optimizer is not None and (self.config.async_save or self._memory.taken):
            self._step_gate = optimizer.register_step_pre_hook(self._gate)

    def _gate(self, *_hook_args: Any) -> None:
        started = time.perf_counter()
        self._wait_for_staging()
        self._memory.wait()
        self.blocked_s += time.perf_counter() - started

    def _wait_for_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            futures_wait([staging])  # a failed copy fails the save; it is reported there

    # ---- save ----------------------------------------------------------------------------------

    def save(self, step: int | None = None) -> None:
        """Save at `step` (default: the last step seen); collective, call on every rank.

        An async save returns while its copy of the shards is still being taken: until the
        tracked optimizer's next step (which waits for it), change parameters and optimizer
        state only through that optimizer, or call `wait()` first.
        """
        self._raise_background_error()
        self._timed_save(self._step_or_last(step))

    def _timed_save(self, step: int, request_id: int = 0) -> None:
        """`request_id`: the notebook's save request this save serves (0: none); the request
        record learns whether the save committed or failed."""
        started = time.perf_counter()
        try:
            self._raise_background_error()
            self._save(self._require_tracked(), step, request_id)
        except BaseException as error:
            if request_id:  # failed before its background part
                self._requests.mark_failed(request_id, describe(error))
            raise
        finally:
            self.blocked_s += time.perf_counter() - started

    def _save(self, tracked: Tracked, step: int, request_id: int) -> None:
        if not self.config.async_save:
            self._save_sync(tracked, step, None, None, request_id)
            return
        self.wait()
        job = self._writer.begin(step, self._fg_group)
        state = training_state_to_save(tracked.model, tracked.optimizer)
        self._last_step = step
        rank_state = capture_rank_state(tracked, step)
        # Without an optimizer step to gate, the copy ends before returning.
        self._staging = self._writer.write_async(job, state, rank_state, tracked.model, stager=self._stager,
                                                 wait_for_copy=self._step_gate is None, request_id=request_id)

    def _save_sync(self, tracked: Tracked, step: int, state: dict[str, Any] | None,
                   rank_state: dict[str, Any] | None, request_id: int = 0) -> None:
        """Save and commit before returning: the live state, or the given one (a snapshot's)."""
        self.wait()
        job = self._writer.begin(step, self._fg_group)
        if state is None or rank_state is None:
            state = training_state_to_save(tracked.model, tracked.optimizer)
            rank_state = capture_rank_state(tracked, step)
            self._last_step = step
        self._writer.write_sync(job, state, rank_state, tracked.model, self._fg_group, request_id)

    def maybe_save(self, step: int) -> bool:
        """The safe point for a save requested from the notebook; True when one was started.

        Every rank must call it at the same step: the ranks agree on the highest request id
        posted anywhere, so a request that reached only some ranks still saves on all of them.
        They agree on a failed background save too: each rank learns of it when its own copy of
        the save ends, and one that raised alone would leave the others waiting here.
        """
        self._check_open()
        step = self._check_step(step)
        self._last_step = step
        failed, wanted = self._all_max((int(self._background.has_error()), self._requests.pending()),
                                       self._fg_group)
        if failed:
            self.wait()  # every rank's save failed alike (see step_writer.py): raises here,
            raise CheckpointSaveError(  # unless this rank's error was already reported elsewhere
                f"rank {self._rank}: an earlier background save failed (see the rank that reports it); "
                f"{NOTHING_LOST}")
        saving = wanted > self._requests.served()
        if saving:
            self._requests.mark_served(wanted, step)
            self._timed_save(step, request_id=wanted)
        if self._memory.due(step):
            self._take_snapshot(step)
        return saving

    def _take_snapshot(self, step: int) -> None:
        started = time.perf_counter()
        # Without an optimizer step to wait for it, the copy ends before returning.
        self._memory.take(self._require_tracked(), step, wait_for_copy=self._step_gate is None)
        self.blocked_s += time.perf_counter() - started

    def save_memory_snapshot(self, path: str | os.PathLike | None = None) -> int:
        """Write the newest snapshot in host memory as a checkpoint of its step, to `path` (a
        checkpoint directory; None: this one); returns the step. Collective. The live model and
        optimizer are not changed (an optimizer that has not stepped yet gets its empty state)."""
        if path is not None and Path(path).absolute() != self.directory:
            with Checkpointer(path, keep=None, async_save=False, checksums=self.config.checksums) as other:
                return self._write_snapshot_with(other)
        return self._write_snapshot_with(self)

    def _write_snapshot_with(self, writer: Checkpointer) -> int:
        self.wait()
        tracked = self._require_tracked()
        step, state, rank_state = self._memory.state_to_write(tracked)
        writer._save_sync(tracked, step, state, rank_state)
        return step

    def snapshot_newer_than_disk(self) -> int | None:
        """Collective: the newest step every rank holds in host memory, where it is newer than
        the newest checkpoint on disk; None otherwise (or without snapshots)."""
        return self._memory.step_to_load("latest")

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and the snapshot in flight (if
        any) is in host memory; raise what failed them."""
        self._memory.wait()
        self._background.wait()
        self._raise_background_error()

    # ---- load ----------------------------------------------------------------------------------

    def load(self, target: int | str | os.PathLike = "latest") -> int:
        """Restore "latest", a step, or a step directory's path; returns the step. Collective.

        All or nothing, on every rank: before any live tensor is touched, the ranks check each
        file's size and CRC32 against what the save recorded (each rank reads its share of the
        files). A damaged step is refused, naming the file; "latest" then takes the newest intact
        step before it and says so.
        """
        self.wait()
        tracked = self._require_tracked()
        memory_step = self._memory.step_to_load(target)
        if memory_step is not None:
            self._last_step = self._memory.restore(tracked, memory_step)
            return memory_step
        step_dir, metadata = self._steps.intact_step_collectively(target, self._fg_group)
        rank_state = read_rank_state_collectively(step_dir, metadata, self._rank, self._fg_group)
        state = checked_training_state(tracked.model, tracked.optimizer, read_dcp_metadata(step_dir), step_dir)
        task = start_state_task("load", f"loading step {metadata.step}", state)
        try:
            dcp.load(state, checkpoint_id=step_dir, process_group=self._fg_group, no_dist=not self._distributed,
                     planner=ProgressLoadPlanner(task))
        except (Exception, CheckpointException) as error:  # the files were whole: a read failed (I/O)
            task.finish(error)
            raise RuntimeError(f"rank {self._rank}: loading step {metadata.step} failed after its files were "  # internal: an I/O failure after the files were checked, not the user's input
                               f"checked: {describe(error)}; the model and optimizer may be partly restored: "
                               "load a step again before training") from error
        except BaseException as error:
            task.finish(error)
            raise
        task.finish()
        set_training_state(tracked.model, tracked.optimizer, state)
        self._memory.forget_after_disk_load()
        restore_rank_state(tracked, rank_state, metadata, self._rank, self._world_size)
        self._last_step = metadata.step
        logger.info("loaded checkpoint step %d from %s", metadata.step, step_dir)
        return metadata.step

    # ---- inspection --------------------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        """The step of the last save, `maybe_save` or load; None before any (what `save()` saves)."""
        return self._last_step

    @property
    def tracked_model(self) -> nn.Module:
        """The model `track()` named; raises RuntimeError before `track()`."""
        return self._require_tracked().model

    def list(self) -> tuple[CheckpointEntry, ...]:
        """Every step directory, oldest first, with `valid` telling which can be loaded."""
        self._raise_background_error()
        return tuple(self._steps.entries())

    def latest(self) -> int | None:
        """The step `load("latest")` would restore, or None: the disk's newest, or the snapshot in
        host memory that `track()` found, if newer."""
        self._raise_background_error()
        return self._memory.latest(self._steps.latest_valid_step())

    def status(self) -> CheckpointStatus:
        """A snapshot for the dashboard; never raises a background error (it reports it)."""
        saving = self._background.saving_step()
        latest_step, entries = self._steps.listing()
        return CheckpointStatus(
            directory=str(self.directory), latest_step=latest_step, saving_step=saving,
            last_error=self._background.last_error_text, entries=entries, blocked_s=self.blocked_s,
            memory_step=self._memory.newest_step(),
        )

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for the save in flight, then release threads and groups; safe to call twice."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            tracking.clear_tracked(self)
            self._background.close()
            self._gate_optimizer_step(None)
            self._memory.close()
            if self._stager is not None:
                self._stager.close()
            self._destroy_groups()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _destroy_groups(self) -> None:
        if self._fg_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._fg_group)
        self._fg_group = None
        self._background.destroy_group()

    # ---- helpers -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady(f"the checkpointer of {self.directory} is closed")

    def _raise_background_error(self) -> None:
        self._check_open()
        self._background.raise_error()

    def _require_tracked(self) -> Tracked:
        if self._tracked is None:
            raise NotReady("nothing to checkpoint: call ckpt.track(model=..., optimizer=...) first")
        return self._tracked

    def _step_or_last(self, step: int | None) -> int:
        if step is not None:
            return self._check_step(step)
        if self._last_step is None:
            raise InvalidValue("step=None but no step has been seen yet: pass save(step)")
        return self._last_step

    @staticmethod
    def _check_step(step: int) -> int:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidValue(f"step={step!r} must be an int >= 0")
        return step

    def _all_max(self, values: tuple[int, ...], group: dist.ProcessGroup | None) -> tuple[int, ...]:
        """The largest of each value over the ranks, in one collective."""
        return collectives.all_max(values, group) if self._distributed else values
