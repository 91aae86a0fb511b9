"""Snapshots of a rank's training state in host memory that outlives the rank (`memory_every=N`).

Every N steps `maybe_save` copies this rank's shards of the tracked state (trainable parameters,
persistent buffers, optimizer state) into one of two slot files of the pool's snapshot store on a
tmpfs (host/memory_store.py; a rank's slots: snapshot_slots.py), and its other state (step, RNG,
scheduler, optimizer hyperparameters, extras) into a small file beside it. The copy runs on a thread: the next forward
and backward only read what it copies, and the tracked optimizer's next step waits for it, as for
an async save. Buffers are the exception: a forward updates running statistics in place, so they
are copied aside before `maybe_save` returns. The slot written is never the one that holds the
newest complete snapshot, and it is marked incomplete on the store's board before the copy starts,
so a rank killed mid-copy leaves its previous snapshot whole. The board (one int64 per rank and
slot, in shared memory) is all a snapshot writes besides its data and small state: the manifest,
with each slot's layout, is written only when a slot is made or its layout changes.

Slots follow the order they were written in, which is the order of their steps: a step lower than
the last one taken (a loop started again from 0) and a load from disk give up both slots first,
so a snapshot of an abandoned run is never restored.

Ranks do not finish their copies at the same moment: a rank may start copying step S while a
slower neighbour still copies S-N. Before overwriting its older slot (step S-2N), a rank waits
until every rank of its host holds S-N, so that one step stays complete on all of them whichever
rank dies. (Ranks on other hosts cannot be seen: across hosts that window stays open.)

Every rank sees the same outcome. A copy that fails on its thread (a neighbour that never
finishes, a full tmpfs) is not raised inside the optimizer's step, where the other ranks would go on
into the next collective without it: the next snapshot begins with one small collective in which
the ranks agree whether any copy failed and whether any rank must make a slot, and every rank
raises alike, or checks the host's room alike. Restoring is collective too: the ranks agree on the
newest step every one of them holds, each reads and checks its part (refused in one line on every
rank, nothing changed, if it was taken of another model, world size or mesh, or cannot be read),
and after copying it back bitwise (snapshot_restore.py) they agree again, so a failure there
fails every rank alike.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp2nb.checkpoint import plain_pickle, snapshot_restore
from fsdp2nb.checkpoint.host_copy import DeviceToHostCopier, QueuedWork, queued_work_of
from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.checkpoint.snapshot_layout import LiveTensors, layout_bytes, live_tensors_of
from fsdp2nb.checkpoint.snapshot_slots import RankSlots, Slot, StoredStep
from fsdp2nb.collectives import (
    FailedElsewhere,
    PostedMax,
    all_gathered_objects,
    all_max,
    all_ranks_succeeded,
    describe,
    gathered_if_all_succeeded,
    post_all_max,
)
from fsdp2nb.errors import Fsdp2nbError, MemorySnapshotRefused
from fsdp2nb.host import memory_store
from fsdp2nb.host_memory import available_bytes
from fsdp2nb.sizes import size

logger = logging.getLogger(__name__)

_AGREED_TAKES = 2
"""The first snapshots of a Checkpointer make its two slots, so the ranks agree before copying them;
later ones post their exchange instead: one that blocks each step costs, on a busy host, a rank's
wake-up (several milliseconds under SCHED_BATCH) where the next forward's all-gather would have
waited anyway."""


class MemorySnapshotFailed(Fsdp2nbError, RuntimeError):
    """A snapshot's copy, or a restore after the ranks agreed on it, failed on some rank; every
    rank raises it, naming the rank and the cause."""


@dataclass(slots=True)
class _Plan:
    """One snapshot as decided on the training thread."""

    step: int
    index: int
    tracked: LiveTensors
    state: bytes
    """The rank's other state, already pickled: what cannot be kept is refused before any copy."""
    new_slot: bool


class MemorySnapshots:
    """One Checkpointer's snapshots in the pool's store; made on every rank (`open_snapshots`)."""

    def __init__(self, folder: Path, directory: Path, *, rank: int, world_size: int, local_ranks: range,
                 group: dist.ProcessGroup | None, copier: Executor | None = None) -> None:
        """`folder`: the Checkpointer's folder of the store, made or checked already; `copier`:
        where copies run (one thread unless a test injects another)."""
        self.folder = folder
        self.directory, self.rank, self.world_size = str(directory), rank, world_size
        self._group = group
        self._rank_slots = RankSlots(folder, self.directory, rank=rank, world_size=world_size, local_ranks=local_ranks)
        self._copier = copier or ThreadPoolExecutor(1, thread_name_prefix="fsdp2nb-memory")
        self._copy: Future | None = None
        self._failure: BaseException | None = None
        """What failed the last copy, until the ranks hear of it at the next snapshot."""
        self._gpu = DeviceToHostCopier()
        self._last_taken: int | None = None
        """The step of the last snapshot this process started (None: none, or given up)."""
        self._tracked: LiveTensors | None = None
        """The tensors copied, found again only when what holds them changes."""
        self._num_agreed_takes = 0
        self._posted: PostedMax | None = None
        """The exchange of the last snapshot, heard at the next one (`take`)."""
        self._unheard: BaseException | None = None
        """What stopped this rank's last snapshot, until every rank hears of it."""
        self.copy_s = 0.0
        """Seconds spent in copies (on the thread)."""
        self.num_taken = 0
        """Snapshots copied whole by this process."""

    # ---- taking ------------------------------------------------------------------------------

    def take(self, tracked: Tracked, step: int) -> None:
        """Start copying the state at `step`; returns once the copy runs. Collective: every rank
        hears whether a copy failed anywhere (then every rank raises, nothing copied) and whether a
        slot must be made (then the ranks check that the host has room, alike). The first
        snapshots, which make the slots, agree before copying; later ones post their exchange and
        hear it at the next snapshot (one skipped where a rank must make a slot then)."""
        heard = self._hear_posted()
        if heard is not None and heard[0]:  # before waiting for this rank's copy: it may wait for the failed rank
            unheard, self._unheard = self._unheard, None
            self._raise_everywhere(unheard, "the snapshots in host memory")
        self._settle()
        plan, error = self._planned(tracked, step)
        if self._num_agreed_takes < _AGREED_TAKES:
            self._num_agreed_takes += 1
            self._take_agreed(plan, error)
            return
        if heard is not None and heard[1]:
            self._make_slot_everywhere(plan)
        if error is not None or plan is None or plan.new_slot:
            self._unheard = error
            self._posted = post_all_max((int(error is not None), int(error is None)), self._group)
            return
        self._posted = post_all_max((0, 0), self._group)
        self._start(plan)

    def _planned(self, tracked: Tracked, step: int) -> tuple[_Plan | None, BaseException | None]:
        """This rank's plan for the snapshot of `step`, or what stops it (a failed copy before it)."""
        error, self._failure = self._failure, None
        if error is not None:
            return None, error
        try:
            return self._plan(tracked, step), None
        except plain_pickle.Unkeepable as exc:
            return None, MemorySnapshotRefused(f"rank {self.rank}: the snapshot of step {step} cannot keep the "
                                               f"tracked state: {exc}; nothing was copied")
        except Exception as exc:  # heard by every rank
            return None, exc

    def _take_agreed(self, plan: _Plan | None, error: BaseException | None) -> None:
        """Agree before copying: raise on every rank if one failed, make slots alike."""
        any_failed, any_new_slot = all_max((int(error is not None), int(plan is not None and plan.new_slot)),
                                           self._group)
        if any_failed:
            self._raise_everywhere(error, "the snapshots in host memory")
        assert plan is not None, "no rank failed"
        if any_new_slot:
            self._make_slot_everywhere(plan)
        self._start(plan)

    def _hear_posted(self) -> tuple[int, ...] | None:
        """The exchange the last snapshot posted (done long since: the ranks trained a step after)."""
        posted, self._posted = self._posted, None
        try:
            return posted.wait() if posted is not None else None
        except Exception:  # the groups were re-formed after a failed cell: that exchange is gone
            return None

    def _plan(self, tracked: Tracked, step: int) -> _Plan:
        if self._last_taken is None:
            self._last_taken = self.newest_step()
        if self._last_taken is not None and step < self._last_taken:
            self.invalidate()  # a rewind: what the abandoned run took must never be restored
        live = self._tracked = live_tensors_of(tracked, self._tracked)
        index = self._rank_slots.slot_to_write()
        slot = self._rank_slots.slots[index]
        state = snapshot_restore.other_state(tracked, step)
        new_slot = slot is None or slot.num_bytes != layout_bytes(live.layout)
        return _Plan(step, index, live, state, new_slot)

    def forget_live(self) -> None:
        """Find the tracked tensors afresh at the next snapshot (parameters or state tensors were
        replaced by other objects behind the optimizer's back)."""
        self._tracked = None

    def invalidate(self) -> None:
        """Give up this rank's snapshots (the live state is no longer where they lead: a load
        from disk, a rewind)."""
        self._settle()
        self._rank_slots.give_up()
        self._last_taken = None

    def _make_slot_everywhere(self, plan: _Plan | None) -> None:
        """Collective: the ranks check the host's room alike, then those that need a slot make it;
        a failure on one fails all."""
        wanted = plan if plan is not None and plan.new_slot else None
        needed = layout_bytes(wanted.tracked.layout) if wanted is not None else 0
        held_slot = self._rank_slots.slots[wanted.index] if wanted is not None else None
        self._check_room(needed, held_slot.num_bytes if held_slot is not None else 0)
        error = None
        if wanted is not None:
            try:
                self._rank_slots.replace(wanted.index, needed)
                wanted.new_slot = False
            except Exception as exc:  # heard by every rank below
                error = exc
        self._raise_everywhere(error, "making a slot for the snapshots in host memory")

    def _start(self, plan: _Plan) -> None:
        """Set buffers aside, then hand the copy to the copy thread."""
        live = plan.tracked
        if live.buffers:
            with torch.no_grad():
                torch._foreach_copy_([aside for _, _, aside in live.buffers],
                                     [buffer for _, buffer, _ in live.buffers])
        ready = queued_work_of(live.sources)
        previous = self.newest_step()
        slot = self._rank_slots.slots[plan.index]
        assert slot is not None, "made above"
        self._last_taken = plan.step
        self._copy = self._copier.submit(self._copy_into, plan, slot, previous, ready)

    def _raise_everywhere(self, error: BaseException | None, what: str) -> None:
        """Collective: raise on every rank if any has an error (its own where it failed)."""
        if error is not None:  # before the others can go on: from now on they wait for this rank's next copy
            self._rank_slots.board.clear_failed(self.rank)
        try:
            all_ranks_succeeded(error, what, self._group)
        except FailedElsewhere as elsewhere:
            raise MemorySnapshotFailed(f"{elsewhere}") from None

    def _settle(self) -> None:
        """Wait for the copy in flight; keep what failed it for the next snapshot's agreement."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        try:
            copy.result()
        except Exception as exc:  # raised on every rank at the next snapshot; logged now in case none follows
            logger.warning("%s", exc)
            self._failure = exc

    def wait(self) -> None:
        """Block until the copy in flight is in its slot (or failed: every rank hears of it at
        the next snapshot, raised alike)."""
        self._settle()

    def newest_step(self) -> int | None:
        """The newest step this rank holds whole (another thread may read it while a copy runs)."""
        return self._rank_slots.newest_step()

    def _check_room(self, needed: int, held: int) -> None:
        """Collective: refuse, on every rank alike and before any copy, slots the host cannot hold."""
        wanted = 0 if not needed else 2 * needed - held if not any(self._rank_slots.slots) else needed - held
        mine = (int(os.environ.get("GROUP_RANK", "0")), max(0, wanted), available_bytes(),
                memory_store.tmpfs_free(self.folder))
        gathered = all_gathered_objects(mine, self._group)
        node = mine[0]
        here = [entry for entry in gathered if entry[0] == node]
        total = sum(entry[1] for entry in here)
        room = min(min(entry[2] for entry in here), min(entry[3] for entry in here))
        if total > room:
            largest = max(entry[1] for entry in gathered)
            raise MemorySnapshotRefused(
                f"memory_every: the snapshots of this host's {len(here)} ranks need {size(total)} more host memory "
                f"(up to {size(largest)} per rank, two copies each) but {size(room)} is available "
                f"(in {memory_store.shared_memory_dir()}); nothing was copied: free memory, or save to disk "
                "only (memory_every=None)")

    def _copy_into(self, plan: _Plan, slot: Slot, previous: int | None, ready: QueuedWork | None) -> None:
        started = time.perf_counter()
        try:
            if previous is not None and not self._rank_slots.wait_for_neighbours(previous):
                return  # a neighbour failed that step: this one is skipped, both slots stay as they are
            board = self._rank_slots.board
            board.set(self.rank, plan.index, None)  # incomplete until the copy is whole
            live = plan.tracked
            self._rank_slots.record_layout(plan.index, live.layout, live.mesh)
            self._copy_tensors(slot.views(live.layout), live.sources, slot, ready)
            memory_store.write_private_file(memory_store.state_path(self.folder, self.rank, plan.index), plan.state)
            board.set(self.rank, plan.index, plan.step)
        except Exception as exc:
            self._rank_slots.board.mark_failed(self.rank, plan.index, plan.step)  # neighbours stop waiting for it
            whole = self.newest_step()
            kept = f"step {whole} is whole" if whole is not None else "no step is whole"
            raise MemorySnapshotFailed(f"rank {self.rank}: the snapshot of step {plan.step} in host memory failed: "
                                       f"{describe(exc)}; {kept}, and training can go on") from exc
        self.copy_s += time.perf_counter() - started
        self.num_taken += 1

    def _copy_tensors(self, views: list[torch.Tensor], sources: list[torch.Tensor], slot: Slot,
                      ready: QueuedWork | None) -> None:
        """All of it in one call: each Python-level op of this thread waits for the GIL that the
        training thread holds, so a copy made of many small calls would take many switches."""
        if ready is not None:
            slot.pin()  # device to page-locked host memory: the copies run without blocking the stream
        self._gpu.run(ready, lambda: torch._foreach_copy_(views, sources, non_blocking=slot.pinned))

    # ---- restoring ---------------------------------------------------------------------------

    def agreed_step(self, *, unless_own: bool = False) -> int | None:
        """Collective: the newest step every rank holds; None if there is none (or, with
        `unless_own`, when every rank's snapshot is this very process's: the state is live)."""
        self._settle()
        manifest = memory_store.read_manifest(self.folder, self.rank) or {}
        taken_on = manifest.get("world_size")
        steps = sorted(self._rank_slots.complete_steps(manifest)) if taken_on == self.world_size else []
        own = manifest.get("pid") == os.getpid()
        gathered = all_gathered_objects((steps, own, taken_on), self._group)
        other_sizes = {entry[2] for entry in gathered if entry[2] not in (None, self.world_size)}
        if other_sizes:
            raise MemorySnapshotRefused(
                f"the snapshot of {self.directory} in host memory was taken on {other_sizes.pop()} ranks, this pool "
                f"has {self.world_size}; nothing was changed: `%fsdp2 stop` frees it (or use another directory)")
        if unless_own and all(entry[1] for entry in gathered):
            return None
        common = set.intersection(*(set(entry[0]) for entry in gathered))
        return max(common) if common else None

    def describe_missing(self) -> str:
        """Why no snapshot can be restored, for `load("memory")`."""
        if not any(self.folder.glob("rank-*.json")):
            return f"no snapshot of {self.directory} is kept in this pool's host memory"
        return f"no step of {self.directory} is held whole by every rank in host memory"

    def restore(self, tracked: Tracked, step: int) -> dict[str, Any]:
        """Collective: copy snapshot `step` into the live state; returns the rank's other state.
        Refused on every rank, nothing changed, if any rank cannot read it or it does not fit; a
        failure while copying it back fails every rank alike."""
        self._settle()
        error: BaseException | None = None
        try:
            stored, state = self._read(step)
            snapshot_restore.check_matches(tracked, stored.layout, state, directory=self.directory,
                                           taken_on_mesh=stored.mesh)
            made = snapshot_restore.missing_optimizer_state(stored.slot, stored.layout, tracked)
        except Exception as exc:  # any failure to read, on any rank, is heard by all before a change
            error = exc if isinstance(exc, MemorySnapshotRefused) else MemorySnapshotRefused(
                f"rank {self.rank}: the snapshot of step {step} cannot be read ({describe(exc)}); nothing was changed")
        try:
            gathered_if_all_succeeded(None, error, "restoring from memory", self._group)
        except FailedElsewhere as elsewhere:
            raise MemorySnapshotRefused(f"{elsewhere}") from None
        error = None
        try:
            snapshot_restore.copy_back(stored.slot, stored.layout, tracked, made, state)
        except Exception as exc:  # heard by every rank below
            error = MemorySnapshotFailed(
                f"rank {self.rank}: restoring step {step} from memory failed: {describe(exc)}; the model and "
                "optimizer may be partly restored: load a step again before training")
        self._raise_everywhere(error, f"restoring step {step} from memory")
        self._rank_slots.adopt(stored, step)
        self._last_taken, self._failure = step, None
        self._tracked = None  # restored optimizer state may be new tensors
        return state

    def _read(self, step: int) -> tuple[StoredStep, dict[str, Any]]:
        """Step `step` as this rank holds it, with its other state unpickled and checked."""
        stored = self._rank_slots.read(step)
        path = memory_store.state_path(self.folder, self.rank, stored.index)
        return stored, snapshot_restore.loaded_other_state(stored.state, step, path)

    def saved_views(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective: the tensors of snapshot `step` (views of its slot) and its other state, for
        writing it to disk; refused on every rank if any cannot read its part."""
        error: BaseException | None = None
        try:
            stored, state = self._read(step)
        except Exception as exc:  # heard by every rank below, before any writes
            error = MemorySnapshotRefused(f"rank {self.rank}: the snapshot of step {step} cannot be read "
                                          f"({describe(exc)}); nothing was written")
        try:
            all_ranks_succeeded(error, "reading the snapshot in host memory", self._group)
        except FailedElsewhere as elsewhere:
            raise MemorySnapshotRefused(f"{elsewhere}") from None
        return {entry.key: stored.slot.view(entry) for entry in stored.layout}, state

    def close(self) -> None:
        """Wait for the copy in flight, then unmap the slots (the store keeps the files)."""
        try:
            self._settle()
            self._hear_posted()
        finally:
            self._copier.shutdown(wait=True)
            self._tracked = None
            self._rank_slots.close()


def open_snapshots(store: str, directory: Path, *, wanted: bool, rank: int, world_size: int,
                   group: dist.ProcessGroup | None) -> MemorySnapshots | None:
    """Collective: a Checkpointer's snapshots in `store`, on every rank when `wanted` (memory_every)
    or when any rank's host holds some of `directory` (a pool restarted after a death); else None
    on every rank. The store's folders are made or checked on every host alike (host/memory_store.py),
    and a folder refused on one rank fails every rank."""
    folder = memory_store.checkpointer_folder(store, directory)
    if not wanted and not all_max((int(folder.is_dir()),), group)[0]:
        return None
    snapshots, error = None, None
    try:
        folder = memory_store.open_checkpointer_folder(store, directory)
        snapshots = MemorySnapshots(folder, directory, rank=rank, world_size=world_size,
                                    local_ranks=local_rank_range(rank), group=group)
    except Exception as exc:  # heard by every rank below
        error = exc
    try:
        all_ranks_succeeded(error, "opening the snapshot store in host memory", group)
    except BaseException:
        if snapshots is not None:
            snapshots.close()
        raise
    return snapshots


def local_rank_range(rank: int) -> range:
    """The ranks of this rank's host, from torchrun's variables (all ranks of one host: together)."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node = int(os.environ.get("GROUP_RANK", str(rank // max(1, local_world_size))))
    return range(node * local_world_size, (node + 1) * local_world_size)


def store_of_this_rank() -> str | None:
    """The pool's snapshot store (set on every rank), or None outside a pool."""
    return os.environ.get(memory_store.MEMORY_DIR_ENV) or None

