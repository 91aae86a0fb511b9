"""Checkpointer: atomic, optionally asynchronous checkpoints of a training run, with retention.

A save runs in three parts. On the calling thread every rank agrees on a temporary directory and
starts copying its shards off the live tensors (`dcp.async_save` staging on a thread: reused
buffers on CPU, pinned memory on GPU); the tracked optimizer's next step waits for that copy.
In the background, DCP serializes, writes and fsyncs the shards (from a thread, or with
async_writer="process" in its persistent writer process, which receives the staged buffers
through shared memory and leaves the training process's GIL alone). A thread of this process
then adds the rank's own file (rank_file.py: RNG, scheduler, extras), the ranks agree that all
succeeded, and rank 0 commits (commit.py: metadata, rename into place, LATEST, retention). A
crash at any point leaves LATEST naming the previous, complete checkpoint.

Background work talks over its own gloo group and the calling thread over another, so a save in
flight never interleaves its collectives with `maybe_save`'s or the training step's. A cell's
failure releases and re-forms the calling thread's groups (`worker/reformable_groups.py`), never
the background one (`in_flight.mark_background_group`): a save in flight goes on through it, and a
synchronous save, which runs on the calling thread, talks over the calling thread's group.

The class stays whole on purpose: save, maybe_save, wait, load and close share the two groups,
the lock and the pending save, and read best in one place (so the module is about 600 lines).
What does not need that state lives beside it: the rank's file (rank_file), the commit
(commit), the saves in flight (in_flight), layout, loadable_steps, direct_writes, staging,
state, collectives, and the snapshots in host memory (memory_snapshots), which the Checkpointer
takes at `maybe_save` and restores at `track()` and `load()`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from fsdp2nb import collectives, progress
from fsdp2nb.checkpoint import in_flight, layout, tracking
from fsdp2nb.checkpoint.commit import SaveJob, commit_step
from fsdp2nb.checkpoint.config import AsyncWriter, CheckpointerConfig
from fsdp2nb.checkpoint.direct_writes import ShardWriter
from fsdp2nb.checkpoint.faults import fault_point
from fsdp2nb.checkpoint.layout import CheckpointEntry
from fsdp2nb.checkpoint.loadable_steps import LoadableSteps
from fsdp2nb.checkpoint.memory_snapshots import MemorySnapshots, open_snapshots, store_of_this_rank
from fsdp2nb.checkpoint.rank_file import (
    Tracked,
    capture_rank_state,
    read_rank_state_collectively,
    restore_rank_state,
    write_rank_state,
)
from fsdp2nb.checkpoint.requests import SaveRequests, process_failures, process_requests
from fsdp2nb.checkpoint.staging import StagedSavePlanner, make_stager
from fsdp2nb.checkpoint.state import (
    checked_training_state,
    read_dcp_metadata,
    set_training_state,
    snapshot_training_state,
    training_state_to_save,
)
from fsdp2nb.checkpoint.state_progress import ProgressLoadPlanner, start_state_task
from fsdp2nb.checkpoint.tracking import CheckpointStatus
from fsdp2nb.collectives import (
    FailedElsewhere,
    all_ranks_succeeded,
    describe,
    make_dir_everywhere,
    on_rank0_agreed,
)
from fsdp2nb.errors import (
    CheckpointLoadError,
    CheckpointSaveError,
    InvalidValue,
    NotReady,
    UsageMistake,
    forget_locals,
)
from fsdp2nb.wire.memory_store import MEMORY_DIR_ENV

logger = logging.getLogger(__name__)

_NOTHING_LOST = "the checkpoints committed before are untouched; fix the cause and save again"


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
        store = store_of_this_rank()
        if memory_every is not None and store is None:
            raise UsageMistake(f"memory_every={memory_every}: snapshots need host memory that outlives the ranks, "
                               f"which a pool provides: run this in a %%fsdp2 cell (or set {MEMORY_DIR_ENV} "
                               "to a directory on a tmpfs)")
        self.directory = Path(directory).absolute()
        self.keep, self.async_save, self.async_writer = keep, async_save, async_writer  # read often; validated above
        self._requests = requests if requests is not None else process_requests()
        self._distributed = collectives.is_distributed()
        self._rank = collectives.get_rank()
        self._world_size = collectives.get_world_size()
        # Two groups: the calling thread's collectives must never interleave with a background save's.
        self._fg_group = collectives.new_gloo_group() if self._distributed else None
        self._bg_group = collectives.new_gloo_group() if self._distributed else None
        if self._bg_group is not None:
            in_flight.mark_background_group(self._bg_group)
        self._closed = False
        self._check_writable()
        self._tracked: Tracked | None = None
        self._last_step: int | None = None
        self._lock = threading.Lock()
        self._steps = LoadableSteps(self.directory, checksums=self.config.checksums, rank=self._rank,
                                    world_size=self._world_size, distributed=self._distributed)
        self._pending: tuple[int, Future] | None = None
        self._error: BaseException | None = None
        self._background_failed = False
        """Whether a background save failed since the background group was made: a collective
        that timed out there leaves gloo's connections closed for good."""
        self._last_error_text: str | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp2nb-ckpt")
        self._stager = make_stager() if async_save else None
        self._staging: Future | None = None  # the copy of the save in flight
        self._step_gate = None  # handle of the optimizer step pre-hook that waits for it
        self.blocked_s = 0.0
        """Seconds this rank's training has waited on saves: inside save() and, for an async
        save, in the next optimizer step's wait for the copy. An async save's writing is not
        counted: it overlaps training (and competes with it for CPU where no core is spare)."""
        if self._rank == 0:
            in_flight.sweep(self.directory)
        self._memory: MemorySnapshots | None = None
        """Snapshots in host memory: taken with memory_every, or restorable from an earlier pool."""
        if store is not None:
            try:  # collective: on every rank alike, or on none
                self._memory = open_snapshots(store, self.directory, wanted=memory_every is not None, rank=self._rank,
                                              world_size=self._world_size, group=self._fg_group)
            except BaseException:
                self._destroy_groups()
                raise
        self._memory_step: int | None = None
        """The snapshot step the ranks agreed on at `track()` (what `latest()` counts)."""

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
        if self._memory is not None:
            self._memory.forget_live()
            self._restore_newer_snapshot(self._memory)
        return self

    def _restore_newer_snapshot(self, memory: MemorySnapshots) -> None:
        """After a pool restart: restore the snapshot the ranks hold when the disk has nothing newer."""
        self._memory_step = step = memory.agreed_step(unless_own=True)
        on_disk = self._steps.latest_valid_step()
        if step is not None and (on_disk is None or step > on_disk):
            self._restore_from_memory(memory, step, on_disk)

    def _restore_from_memory(self, memory: MemorySnapshots, step: int, on_disk: int | None) -> int:
        started = time.perf_counter()
        memory.restore(self._require_tracked(), step)
        self._last_step = step
        if self._rank == 0:
            disk = f"the disk's newest is step {on_disk}" if on_disk is not None else "the disk has no checkpoint"
            print(f"restored step {step} from memory in {time.perf_counter() - started:.1f} s; {disk}", flush=True)
        return step

    def _gate_optimizer_step(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the optimizer's step, the first write to what a save copies, wait for the copy."""
        if self._step_gate is not None:
            self._step_gate.remove()
            self._step_gate = None
        if optimizer is not None and (self.async_save or self.config.memory_every is not None):
            self._step_gate = optimizer.register_step_pre_hook(self._gate)

    def _gate(self, *_hook_args: Any) -> None:
        started = time.perf_counter()
        self._wait_for_staging()
        if self._memory is not None:
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
        if not self.async_save:
            self._save_sync(tracked, step, None, None, request_id)
            return
        self.wait()
        job = self._begin(step)
        state = training_state_to_save(tracked.model, tracked.optimizer)
        self._last_step = step
        rank_state = capture_rank_state(tracked, step)
        task = start_state_task("save", f"saving step {step}", state)
        writer = ShardWriter(job.tmp_dir, task=task, checksums=self.config.checksums)
        use_process = self.async_writer == "process" and self._distributed
        with self._abandoned_on_failure(job, task):
            response = dcp.async_save(
                state, storage_writer=writer, process_group=self._bg_group, async_stager=self._stager,
                planner=StagedSavePlanner(), no_dist=not self._distributed,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if use_process else AsyncCheckpointerType.THREAD,
            )
        if isinstance(response, Future):  # staged before async_save returned
            upload = response
        else:
            upload, self._staging = response.upload_completion, response.staging_completion
            if self._step_gate is None:  # no optimizer step to gate: copy before returning
                self._wait_for_staging()
        future = self._executor.submit(self._finish_in_background, job, rank_state, upload, tracked.model, task,
                                       request_id)
        with self._lock:
            self._pending = (step, future)

    def _save_sync(self, tracked: Tracked, step: int, state: dict[str, Any] | None,
                   rank_state: dict[str, Any] | None, request_id: int = 0) -> None:
        """Save and commit before returning: the live state, or the given one (a snapshot's)."""
        self.wait()
        job = self._begin(step)
        if state is None or rank_state is None:
            state = training_state_to_save(tracked.model, tracked.optimizer)
            rank_state = capture_rank_state(tracked, step)
            self._last_step = step
        task = start_state_task("save", f"saving step {step}", state)
        writer = ShardWriter(job.tmp_dir, task=task, checksums=self.config.checksums)
        with self._abandoned_on_failure(job, task):
            dcp.save(state, storage_writer=writer, process_group=self._fg_group, no_dist=not self._distributed)
        self._finish(job, rank_state, None, tracked.model, task, request_id, self._fg_group)

    @contextlib.contextmanager
    def _abandoned_on_failure(self, job: SaveJob, task: progress.AnyTask):
        """A save that DCP failed (on every rank alike) leaves no temporary directory."""
        try:
            yield
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            task.finish(exc)
            in_flight.ended(job.tmp_dir)
            shutil.rmtree(job.tmp_dir, ignore_errors=True)
            raise self._save_failed(job, exc) from exc

    def _save_failed(self, job: SaveJob, cause: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(f"rank {self._rank}: save of step {job.step} failed: {describe(cause)}; "
                                   f"{_NOTHING_LOST}")

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
        failed, wanted = self._all_max((int(self._has_background_error()), self._requests.pending()),
                                       self._fg_group)
        if failed:
            self.wait()  # every rank's save failed alike (see _finish_and_commit): raises here,
            raise CheckpointSaveError(  # unless this rank's error was already reported elsewhere
                f"rank {self._rank}: an earlier background save failed (see the rank that reports it); "
                f"{_NOTHING_LOST}")
        saving = wanted > self._requests.served()
        if saving:
            self._requests.mark_served(wanted, step)
            self._timed_save(step, request_id=wanted)
        every = self.config.memory_every
        if every is not None and step % every == 0:
            self._take_snapshot(step)
        return saving

    def _take_snapshot(self, step: int) -> None:
        assert self._memory is not None, "made with memory_every"
        started = time.perf_counter()
        self._memory.take(self._require_tracked(), step)
        if self._step_gate is None:  # no optimizer step to wait for it: the copy ends before returning
            self._memory.wait()
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
        memory = self._memory
        step = memory.agreed_step() if memory is not None else None
        if memory is None or step is None:
            raise CheckpointLoadError(self._no_snapshot(memory) + "; nothing was written")
        memory.wait()
        tracked = self._require_tracked()
        views, other = memory.saved_views(step)
        state = snapshot_training_state(tracked, views, other["param_groups"])
        rank_state = {"step": step, "rng": other["rng"], "scheduler": other["scheduler"], "extra": other["extra"]}
        writer._save_sync(tracked, step, state, rank_state)
        return step

    def snapshot_newer_than_disk(self) -> int | None:
        """Collective: the newest step every rank holds in host memory, where it is newer than
        the newest checkpoint on disk; None otherwise (or without snapshots)."""
        return self._memory_step_to_load("latest")

    def _no_snapshot(self, memory: MemorySnapshots | None) -> str:
        if memory is None:
            return (f"no snapshot of {self.directory} is kept in host memory (make the Checkpointer with "
                    "memory_every=N, in a %%fsdp2 cell)")
        return memory.describe_missing()

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed and the snapshot in flight (if
        any) is in host memory; raise what failed them."""
        if self._memory is not None:
            self._memory.wait()
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending[1].exception()  # waits without raising; the error is raised below
        self._raise_background_error()

    def _begin(self, step: int) -> SaveJob:
        """Agree on the step and a fresh temporary directory (rank 0 first sweeps away abandoned
        ones); after a failed background save, renew the background group."""
        highest, negated_lowest, renew = self._all_max((step, -step, int(self._background_failed)), self._fg_group)
        if highest != -negated_lowest:
            raise UsageMistake(f"the ranks asked to save different steps ({-negated_lowest} to {highest}); "
                               "call save(step) with the same step on every rank")
        if renew:
            self._renew_background_group()
        what = f"creating the directory of step {step}"
        try:
            token, wall_time = on_rank0_agreed(lambda: self._make_tmp_dir(step), what, self._fg_group)
            tmp_dir = self.directory / layout.tmp_dir_name(step, token)
            make_dir_everywhere(tmp_dir, what, self._fg_group)
        except (OSError, FailedElsewhere) as exc:
            raise CheckpointSaveError(f"rank {self._rank}: save of step {step} could not start: {describe(exc)}; "
                                      f"{_NOTHING_LOST}") from exc
        in_flight.started(tmp_dir)
        return SaveJob(step=step, token=token, tmp_dir=tmp_dir, wall_time=wall_time)

    def _renew_background_group(self) -> None:
        """Fresh connections for background saves after one failed; every rank calls it (in
        `_begin`, once the ranks agreed), with no save in flight."""
        if self._bg_group is None:
            return
        old, self._bg_group = self._bg_group, collectives.new_gloo_group()
        in_flight.mark_background_group(self._bg_group)
        dist.destroy_process_group(old)
        del old
        gc.collect()  # the failed save's work objects hold its connections in reference cycles
        self._background_failed = False

    def _make_tmp_dir(self, step: int) -> tuple[str, float]:
        """Rank 0: a fresh temporary directory for `step` (after sweeping abandoned ones)."""
        in_flight.sweep(self.directory)
        token = secrets.token_hex(4)
        (self.directory / layout.tmp_dir_name(step, token)).mkdir()
        return token, time.time()

    def _finish(self, job: SaveJob, rank_state: dict[str, Any], upload: Future | None,
                model: nn.Module, task: progress.AnyTask, request_id: int, group: dist.ProcessGroup | None) -> None:
        """Wait for the shards, add this rank's file, then commit once every rank succeeded; `group`
        is the thread's own (the background group on the save thread)."""
        try:
            self._finish_and_commit(job, rank_state, upload, model, group)
            task.finish()
            if request_id:  # after the task's end: the panel says "saved" with the bar full
                self._requests.mark_committed(request_id)
        except BaseException as error:
            task.finish(error)
            if request_id:
                self._requests.mark_failed(request_id, describe(error))
            raise
        finally:
            in_flight.ended(job.tmp_dir)

    def _finish_in_background(self, job: SaveJob, rank_state: dict[str, Any], upload: Future | None,
                              model: nn.Module, task: progress.AnyTask, request_id: int) -> None:
        """`_finish` on the save thread, over the background group. A failure is posted for the
        end of the next cell to say, unless a call that raises it (`save`, `wait`) comes first."""
        try:
            self._finish(job, rank_state, upload, model, task, request_id, self._bg_group)
        except BaseException as error:
            self._background_failed = True
            process_failures().post(f"the background save of step {job.step} failed: {error}")
            forget_locals(error)  # it is kept until a cell raises it: not its staged tensors and group
            raise

    def _finish_and_commit(self, job: SaveJob, rank_state: dict[str, Any], upload: Future | None,
                           model: nn.Module, group: dist.ProcessGroup | None) -> None:
        error: BaseException | None = None
        try:
            if upload is not None:
                upload.result()
            fault_point("write_shards", self._rank)  # this rank's shards are on disk
            write_rank_state(job.tmp_dir, self._rank, rank_state)
        except (Exception, CheckpointException) as exc:  # reported to every rank below, then raised
            error = exc
        try:
            all_ranks_succeeded(error, f"save of step {job.step}", group)
        except (Exception, CheckpointException) as exc:
            raise self._save_failed(job, exc) from exc
        try:
            on_rank0_agreed(lambda: commit_step(job, self.directory, model, world_size=self._world_size,
                                                keep=self.keep, rank=self._rank),
                            f"commit of step {job.step}", group)
        except Exception as exc:
            raise CheckpointSaveError(f"rank {self._rank}: commit of step {job.step} failed: {describe(exc)}; "
                                      "LATEST still names the step it named before") from exc
        logger.info("checkpoint step %d committed to %s", job.step, self.directory)

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
        memory_step = self._memory_step_to_load(target)
        if memory_step is not None:
            on_disk = self._steps.latest_valid_step()
            return self._restore_from_memory(self._memory, memory_step, on_disk)  # type: ignore[arg-type]
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
        if self._memory is not None:
            self._memory.forget_live()
            self._memory.invalidate()  # snapshots after this step belong to the run it abandons
        restore_rank_state(tracked, rank_state, metadata, self._rank, self._world_size)
        self._last_step = metadata.step
        logger.info("loaded checkpoint step %d from %s", metadata.step, step_dir)
        return metadata.step

    def _memory_step_to_load(self, target: int | str | os.PathLike) -> int | None:
        """The snapshot step `load(target)` restores: "memory" asks for it (refused in one line
        without one), "latest" takes it when it is newer than the disk's newest."""
        if target != "memory" and (target != "latest" or self._memory is None):
            return None
        memory = self._memory
        if memory is not None:
            memory.wait()
        step = memory.agreed_step() if memory is not None else None
        if target == "memory":
            if step is None:
                raise CheckpointLoadError(self._no_snapshot(memory) + "; nothing was loaded")
            return step
        on_disk = self._steps.latest_valid_step()
        return step if step is not None and (on_disk is None or step > on_disk) else None

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
        on_disk = self._steps.latest_valid_step()
        if self._memory_step is not None and (on_disk is None or self._memory_step > on_disk):
            return self._memory_step
        return on_disk

    def status(self) -> CheckpointStatus:
        """A snapshot for the dashboard; never raises a background error (it reports it)."""
        self._collect()
        with self._lock:
            saving = self._pending[0] if self._pending is not None else None
            error_text = self._last_error_text
        latest_step, entries = self._steps.listing()
        return CheckpointStatus(
            directory=str(self.directory), latest_step=latest_step, saving_step=saving,
            last_error=error_text, entries=entries, blocked_s=self.blocked_s,
            memory_step=self._memory.newest_step() if self._memory is not None else None,
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
            self._executor.shutdown(wait=True)
            self._gate_optimizer_step(None)
            if self._memory is not None:
                self._memory.close()
            if self._stager is not None:
                self._stager.close()
            self._destroy_groups()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _destroy_groups(self) -> None:
        for group in (self._fg_group, self._bg_group):
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)
        self._fg_group = self._bg_group = None

    # ---- helpers -------------------------------------------------------------------------------

    def _collect(self) -> None:
        """Move a finished background save's outcome into the error slot."""
        with self._lock:
            if self._pending is None or not self._pending[1].done():
                return
            step, future = self._pending
            self._pending = None
            exc = future.exception()
            if exc is not None:
                self._error = exc
                self._last_error_text = f"step {step}: {exc}"

    def _check_open(self) -> None:
        if self._closed:
            raise NotReady(f"the checkpointer of {self.directory} is closed")

    def _has_background_error(self) -> bool:
        self._collect()
        with self._lock:
            return self._error is not None

    def _raise_background_error(self) -> None:
        self._check_open()
        self._collect()
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            process_failures().take()  # said by this error
            raise CheckpointSaveError(f"an earlier background save failed: {error}") from error

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
