"""Writing one step's checkpoint: agree on it, write the shards, then finish and commit it.

A save runs in three parts. On the calling thread every rank agrees on a temporary directory and
starts copying its shards off the live tensors (`dcp.async_save` staging on a thread: reused
buffers on CPU, pinned memory on GPU); the tracked optimizer's next step waits for that copy.
In the background, DCP serializes, writes and fsyncs the shards (from a thread, or with
async_writer="process" in its persistent writer process, which receives the staged buffers
through shared memory and leaves the training process's GIL alone). A thread of this process
then adds the rank's own file (rank_file.py: RNG, scheduler, extras), the ranks agree that all
succeeded, and rank 0 commits (commit.py: metadata, rename into place, LATEST, retention). A
crash at any point leaves LATEST naming the previous, complete checkpoint. A synchronous save
runs the same parts on the calling thread, over the calling thread's group.

The Checkpointer decides when to save and what; this module holds how a step gets to disk.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from fsdp2nb import collectives, progress
from fsdp2nb.checkpoint import in_flight, layout
from fsdp2nb.checkpoint.background_saves import BackgroundSaves
from fsdp2nb.checkpoint.commit import SaveJob, commit_step
from fsdp2nb.checkpoint.config import AsyncWriter
from fsdp2nb.checkpoint.direct_writes import ShardWriter
from fsdp2nb.checkpoint.faults import fault_point
from fsdp2nb.checkpoint.rank_file import write_rank_state
from fsdp2nb.checkpoint.requests import SaveRequests
from fsdp2nb.checkpoint.staging import StagedSavePlanner
from fsdp2nb.checkpoint.state_progress import start_state_task
from fsdp2nb.collectives import (
    FailedElsewhere,
    all_ranks_succeeded,
    describe,
    make_dir_everywhere,
    on_rank0_agreed,
)
from fsdp2nb.errors import CheckpointSaveError, UsageMistake

logger = logging.getLogger(__name__)

NOTHING_LOST = "the checkpoints committed before are untouched; fix the cause and save again"


class StepWriter:
    """Writes steps into one checkpoint directory, on this rank, with every other rank."""

    def __init__(self, directory: Path, *, keep: int | None, checksums: bool, async_writer: AsyncWriter,
                 rank: int, world_size: int, distributed: bool, requests: SaveRequests,
                 background: BackgroundSaves) -> None:
        self.directory, self._keep, self._checksums, self._async_writer = directory, keep, checksums, async_writer
        self._rank, self._world_size, self._distributed = rank, world_size, distributed
        self._requests = requests
        """The notebook's save requests: each learns whether the save serving it committed or failed."""
        self._background = background

    def begin(self, step: int, group: dist.ProcessGroup | None) -> SaveJob:
        """Agree on the step and a fresh temporary directory (rank 0 first sweeps away abandoned
        ones); after a failed background save, renew the background group."""
        agreed = (step, -step, int(self._background.failed_since_group))
        highest, negated_lowest, renew = collectives.all_max(agreed, group) if self._distributed else agreed
        if highest != -negated_lowest:
            raise UsageMistake(f"the ranks asked to save different steps ({-negated_lowest} to {highest}); "
                               "call save(step) with the same step on every rank")
        if renew:
            self._background.renew_group()
        what = f"creating the directory of step {step}"
        try:
            token, wall_time = on_rank0_agreed(lambda: self._make_tmp_dir(step), what, group)
            tmp_dir = self.directory / layout.tmp_dir_name(step, token)
            make_dir_everywhere(tmp_dir, what, group)
        except (OSError, FailedElsewhere) as exc:
            raise CheckpointSaveError(f"rank {self._rank}: save of step {step} could not start: {describe(exc)}; "
                                      f"{NOTHING_LOST}") from exc
        in_flight.started(tmp_dir)
        return SaveJob(step=step, token=token, tmp_dir=tmp_dir, wall_time=wall_time)

    def _make_tmp_dir(self, step: int) -> tuple[str, float]:
        """Rank 0: a fresh temporary directory for `step` (after sweeping abandoned ones)."""
        in_flight.sweep(self.directory)
        token = secrets.token_hex(4)
        (self.directory / layout.tmp_dir_name(step, token)).mkdir()
        return token, time.time()

    def write_async(self, job: SaveJob, state: dict[str, Any], rank_state: dict[str, Any], model: nn.Module, *,
                    stager: AsyncStager | None, wait_for_copy: bool, request_id: int) -> Future | None:
        """Start copying the shards and hand the rest to the save thread; returns the copy still in
        flight (None when it ended, or `wait_for_copy` waited for it)."""
        task = start_state_task("save", f"saving step {job.step}", state)
        writer = ShardWriter(job.tmp_dir, task=task, checksums=self._checksums)
        use_process = self._async_writer == "process" and self._distributed
        with self._abandoned_on_failure(job, task):
            response = dcp.async_save(
                state, storage_writer=writer, process_group=self._background.group, async_stager=stager,
                planner=StagedSavePlanner(), no_dist=not self._distributed,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if use_process else AsyncCheckpointerType.THREAD,
            )
        staging: Future | None = None
        if isinstance(response, Future):  # staged before async_save returned
            upload = response
        else:
            upload, staging = response.upload_completion, response.staging_completion
            if wait_for_copy:
                futures_wait([staging])  # a failed copy fails the save; it is reported there
                staging = None
        self._background.start(job.step, lambda group: self.finish(job, rank_state, upload, model, task,
                                                                   request_id, group))
        return staging

    def write_sync(self, job: SaveJob, state: dict[str, Any], rank_state: dict[str, Any], model: nn.Module,
                   group: dist.ProcessGroup | None, request_id: int) -> None:
        """Write the shards and commit before returning."""
        task = start_state_task("save", f"saving step {job.step}", state)
        writer = ShardWriter(job.tmp_dir, task=task, checksums=self._checksums)
        with self._abandoned_on_failure(job, task):
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=not self._distributed)
        self.finish(job, rank_state, None, model, task, request_id, group)

    @contextlib.contextmanager
    def _abandoned_on_failure(self, job: SaveJob, task: progress.AnyTask) -> Iterator[None]:
        """A save that DCP failed (on every rank alike) leaves no temporary directory."""
        try:
            yield
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            task.finish(exc)
            in_flight.ended(job.tmp_dir)
            shutil.rmtree(job.tmp_dir, ignore_errors=True)
            raise self._failed(job, exc) from exc

    def _failed(self, job: SaveJob, cause: BaseException) -> CheckpointSaveError:
        return CheckpointSaveError(f"rank {self._rank}: save of step {job.step} failed: {describe(cause)}; "
                                   f"{NOTHING_LOST}")

    def finish(self, job: SaveJob, rank_state: dict[str, Any], upload: Future | None,
               model: nn.Module, task: progress.AnyTask, request_id: int, group: dist.ProcessGroup | None) -> None:
        """Wait for the shards, add this rank's file, then commit once every rank succeeded; `group`
        is the thread's own (the background group on the save thread, see background_saves.py)."""
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
            raise self._failed(job, exc) from exc
        try:
            on_rank0_agreed(lambda: commit_step(job, self.directory, model, world_size=self._world_size,
                                                keep=self._keep, rank=self._rank),
                            f"commit of step {job.step}", group)
        except Exception as exc:
            raise CheckpointSaveError(f"rank {self._rank}: commit of step {job.step} failed: {describe(exc)}; "
                                      "LATEST still names the step it named before") from exc
        logger.info("checkpoint step %d committed to %s", job.step, self.directory)
