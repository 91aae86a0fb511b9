"""Snapshots of a rank's training state in host memory that outlives the rank (`memory_every=N`).

Every N steps `maybe_save` copies this rank's shards of the tracked state (trainable parameters,
persistent buffers, optimizer state) into one of two slot files of the pool's snapshot store on a
tmpfs (wire/memory_store.py), and its other state (step, RNG, scheduler, optimizer
hyperparameters, extras) into a small file beside it. The copy runs on a thread: the next forward
and backward only read what it copies, and the tracked optimizer's next step waits for it, as for
an async save. The slot written is never the one that holds the newest complete snapshot, and it
is marked incomplete on the store's board before the copy starts, so a rank killed mid-copy leaves
its previous snapshot whole. The board (one int64 per rank and slot, in shared memory) is all a
snapshot writes besides its data: the manifest, with each slot's layout, is written only when a
slot is made or its layout changes.

Ranks do not finish their copies at the same moment: a rank may start copying step S while a
slower neighbour still copies S-N. Before overwriting its older slot (step S-2N), a rank waits
until every rank of its host holds S-N, so that one step stays complete on all of them whichever
rank dies. (Ranks on other hosts cannot be seen: across hosts that window stays open.)

Restoring is collective: the ranks agree on the newest step every one of them holds, check that
the snapshot was taken of this model on this world size and mesh (refused in one line, nothing
changed), then copy it back into the live tensors bitwise.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp2nb.checkpoint import plain_pickle
from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.checkpoint.rng import capture_rng_state, restore_rng_state
from fsdp2nb.checkpoint.snapshot_files import Board, Slot, tmpfs_free
from fsdp2nb.checkpoint.snapshot_layout import (
    Entry,
    layout_bytes,
    layout_of,
    live_tensors,
    local_shard,
    mesh_description,
)
from fsdp2nb.collectives import FailedElsewhere, all_gathered_objects, describe, gathered_if_all_succeeded
from fsdp2nb.errors import MemorySnapshotRefused
from fsdp2nb.host_memory import available_bytes
from fsdp2nb.sizes import size
from fsdp2nb.wire import memory_store
from fsdp2nb.wire.memory_store import MANIFEST_VERSION, complete_steps, read_board

_PEER_POLL_S = 0.0005
_PEER_WAIT_S = 120.0
"""How long a copy waits for a neighbour's previous one; past it the neighbour is stuck or failed
(its own error says why) and this snapshot is given up rather than spin on."""
_MAX_LISTED = 4


class MemorySnapshots:
    """One Checkpointer's snapshots in the pool's store; made on every rank."""

    def __init__(self, store: str, directory: Path, *, rank: int, world_size: int, local_ranks: range,
                 group: dist.ProcessGroup | None) -> None:
        self.folder = memory_store.checkpointer_folder(store, directory)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # another host's store may not exist yet
        self.directory, self.rank, self.world_size = str(directory), rank, world_size
        self.local_ranks, self._group = local_ranks, group
        self._slots: list[Slot | None] = [None, None]
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="fsdp2nb-memory")
        self._copy: Future | None = None
        self._stream: torch.cuda.Stream | None = None
        self._board = Board(memory_store.board_path(self.folder), world_size)
        self.manifest = memory_store.read_manifest(self.folder, rank) or {}
        self._written_layouts: list[list[Entry] | None] = [None, None]
        """The layout objects the manifest holds for each slot as written by this process."""
        self._restored_mesh: str | None = None
        self._opened_index = 0
        self._live_key: tuple | None = None
        self._live: dict[str, torch.Tensor] = {}
        self._last_identity: tuple = ()
        self._last_layout: list[Entry] = []
        self._last_sources: list[torch.Tensor] = []
        self._last_mesh = ""
        self.copy_s = 0.0
        """Seconds spent in copies (on the thread)."""
        self.num_taken = 0
        """Snapshots copied whole by this process."""

    # ---- taking ------------------------------------------------------------------------------

    def take(self, tracked: Tracked, step: int) -> None:
        """Start copying the state at `step`; returns once the copy runs. Collective only when
        slots are (re)made: the ranks agree that the host has room for them first."""
        self.wait()
        tensors = self._live_tensors(tracked)
        layout, sources, mesh = self._layout_of(tensors, tracked.model)
        index = self._slot_to_write()
        slot = self._slot_for(index, layout)
        other_state = _other_state(tracked, step)
        ready = _queued_gpu_work(sources)
        previous = self.newest_step()
        self._copy = self._copier.submit(self._copy_into, index, slot, step, layout, sources, other_state, previous,
                                         mesh, ready)

    def _live_tensors(self, tracked: Tracked) -> dict[str, torch.Tensor]:
        """`live_tensors` of the tracked state, found again only when the model or optimizer or an
        optimizer state of a parameter is another object: walking the modules each step cost more
        than the copy. Parameters replaced by other objects (not updated in place) between two
        snapshots need `forget_live()` (`track()` and `load()` call it)."""
        optimizer = tracked.optimizer
        key = (id(tracked.model), id(optimizer),
               tuple(map(id, optimizer.state.values())) if optimizer is not None else ())
        if key != self._live_key:
            self._live_key, self._live = key, live_tensors(tracked.model, optimizer)
        return self._live

    def forget_live(self) -> None:
        """Find the tracked tensors afresh at the next snapshot."""
        self._live_key = None

    def _layout_of(self, tensors: dict[str, torch.Tensor],
                   model: nn.Module) -> tuple[list[Entry], list[torch.Tensor], str]:
        """The layout of `tensors`, their local tensors and the mesh: the last ones again while
        the same tensors are tracked (training updates them in place; a load or a new optimizer
        state makes new ones)."""
        identity = tuple(map(id, tensors.values()))
        if identity != self._last_identity:
            sources = [local_shard(tensor).detach() for tensor in tensors.values()]
            self._last_identity, self._last_layout, self._last_sources = identity, layout_of(tensors), sources
            self._last_mesh = mesh_description(model)
        return self._last_layout, self._last_sources, self._last_mesh

    def wait(self) -> None:
        """Block until the copy in flight is in its slot; raise what failed it."""
        copy, self._copy = self._copy, None
        if copy is not None:
            copy.result()

    def newest_step(self) -> int | None:
        """The newest step this rank holds whole (another thread may read it while a copy runs)."""
        newest = max(self._board.get(self.rank, 0), self._board.get(self.rank, 1))
        return newest if newest >= 0 else None

    def _slot_to_write(self) -> int:
        """The slot that does not hold the newest complete snapshot."""
        first, second = self._board.get(self.rank, 0), self._board.get(self.rank, 1)
        return 0 if first < second else 1

    def _slot_for(self, index: int, layout: list[Entry]) -> Slot:
        needed = layout_bytes(layout)
        slot = self._slots[index]
        if slot is not None and slot.num_bytes == needed:
            return slot
        self._check_room(needed, slot.num_bytes if slot is not None else 0)
        if slot is not None:
            slot.close()
        self._slots[index] = slot = Slot(memory_store.slot_path(self.folder, self.rank, index), needed)
        return slot

    def _check_room(self, needed: int, held: int) -> None:
        """Refuse, on every rank alike and before any copy, slots the host cannot hold."""
        wanted = 2 * needed - held if not any(self._slots) else needed - held
        mine = (int(os.environ.get("GROUP_RANK", "0")), max(0, wanted), available_bytes(), tmpfs_free(self.folder))
        gathered = all_gathered_objects(mine, self._group)
        node = mine[0]
        here = [entry for entry in gathered if entry[0] == node]
        total = sum(entry[1] for entry in here)
        room = min(min(entry[2] for entry in here), min(entry[3] for entry in here))
        if total > room:
            raise MemorySnapshotRefused(
                f"memory_every: the snapshots of this host's {len(here)} ranks need {size(total)} more host memory "
                f"(two copies of {size(needed)} per rank) but {size(room)} is available "
                f"(in {memory_store.shared_memory_dir()}); nothing was copied: free memory, or save to disk "
                "only (memory_every=None)")

    def _copy_into(self, index: int, slot: Slot, step: int, layout: list[Entry], sources: list[torch.Tensor],
                   other_state: dict[str, Any], previous: int | None, mesh: str, ready: Any) -> None:
        started = time.perf_counter()
        if previous is not None:
            self._wait_for_neighbours(previous)
        self._board.set(self.rank, index, None)  # incomplete until the copy is whole
        if self._written_layouts[index] is not layout or self.manifest.get("mesh") != mesh:
            self._write_manifest(index, layout, mesh)
        self._copy_tensors(slot.views(layout), sources, slot, ready)
        (slot.path.parent / f"{slot.path.name}.state").write_bytes(plain_pickle.dumps(other_state))
        self._board.set(self.rank, index, step)
        self.copy_s += time.perf_counter() - started
        self.num_taken += 1

    def _copy_tensors(self, views: list[torch.Tensor], sources: list[torch.Tensor], slot: Slot,
                      ready: torch.cuda.Event | None) -> None:
        """All of it in one call: each Python-level op of this thread waits for the GIL that the
        training thread holds, so a copy made of many small calls would take many switches."""
        if ready is None:
            torch._foreach_copy_(views, sources)
            return
        slot.pin()  # device to page-locked host memory: the copies run without blocking the stream
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)  # after the step that made the state
            torch._foreach_copy_(views, sources, non_blocking=slot.pinned)
        self._stream.synchronize()

    def _wait_for_neighbours(self, step: int) -> None:
        """Until every rank of this host holds `step` (see the module's docstring)."""
        deadline = time.monotonic() + _PEER_WAIT_S
        while behind := [rank for rank in self.local_ranks if self._board.newest(rank) < step]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: rank {behind[0]} did not finish its snapshot of step {step} "
                                   f"in {_PEER_WAIT_S:.0f} s; this snapshot was given up, the previous one is whole")
            time.sleep(_PEER_POLL_S)

    def _write_manifest(self, index: int | None, layout: list[Entry] | None, mesh: str) -> None:
        """This process's manifest, with `layout` as slot `index`'s (None: the layouts as they are)."""
        layouts = list(self.manifest.get("layouts") or [None, None])
        if index is not None and layout is not None:
            layouts[index] = [entry.as_json() for entry in layout]
            self._written_layouts[index] = layout
        self.manifest = {
            "version": MANIFEST_VERSION, "directory": self.directory, "rank": self.rank,
            "world_size": self.world_size, "local_world_size": len(self.local_ranks), "mesh": mesh,
            "pid": os.getpid(), "layouts": layouts,
        }
        memory_store.write_manifest(self.folder, self.rank, self.manifest)

    def _complete_steps(self, manifest: dict[str, Any]) -> dict[int, int]:
        return complete_steps(manifest, read_board(self.folder, self.world_size))

    # ---- restoring ---------------------------------------------------------------------------

    def agreed_step(self, *, unless_own: bool = False) -> int | None:
        """Collective: the newest step every rank holds; None if there is none (or, with
        `unless_own`, when every rank's snapshot is this very process's: the state is live)."""
        manifest = memory_store.read_manifest(self.folder, self.rank) or {}
        taken_on = manifest.get("world_size")
        steps = sorted(self._complete_steps(manifest)) if taken_on == self.world_size else []
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
        """Collective: copy snapshot `step` into the live state; returns the rank's other state
        (applied by the caller). Refused on every rank, nothing changed, if it does not fit."""
        error: BaseException | None = None
        try:
            slot, layout, blob = self._open_step(step)
            state = plain_pickle.loads(blob)
            self._check_matches(tracked, layout, state)
        except (MemorySnapshotRefused, OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
            error = exc if isinstance(exc, MemorySnapshotRefused) else MemorySnapshotRefused(
                f"rank {self.rank}: the snapshot of step {step} cannot be read ({describe(exc)}); nothing was changed")
        try:
            gathered_if_all_succeeded(None, error, "restoring from memory", self._group)
        except FailedElsewhere as elsewhere:
            raise MemorySnapshotRefused(f"{elsewhere}") from None
        _copy_back(slot, layout, tracked)
        if tracked.optimizer is not None:
            for live, saved in zip(tracked.optimizer.param_groups, state["param_groups"], strict=True):
                live.update(saved)
        if tracked.scheduler is not None and state["scheduler"] is not None:
            tracked.scheduler.load_state_dict(state["scheduler"])
        for name, obj in tracked.extra.items():
            if name in state["extra"]:
                obj.load_state_dict(state["extra"][name])
        restore_rng_state(state["rng"])
        self._adopt(slot, step)
        return state

    def _open_step(self, step: int) -> tuple[Slot, list[Entry], bytes]:
        manifest = memory_store.read_manifest(self.folder, self.rank)
        if manifest is None:
            raise MemorySnapshotRefused(f"rank {self.rank} has no snapshot manifest in {self.folder}")
        index = self._complete_steps(manifest)[step]
        layout = [Entry.from_json(row) for row in manifest["layouts"][index]]
        path = memory_store.slot_path(self.folder, self.rank, index)
        slot = self._slots[index]
        if slot is None or slot.num_bytes != layout_bytes(layout):
            slot = Slot(path, layout_bytes(layout))
        self.manifest = manifest
        self._restored_mesh = manifest.get("mesh")
        self._opened_index = index
        return slot, layout, (path.parent / f"{path.name}.state").read_bytes()

    def _check_matches(self, tracked: Tracked, layout: list[Entry], state: dict[str, Any]) -> None:
        optimizer = tracked.optimizer
        if optimizer is not None and len(state["param_groups"]) != len(optimizer.param_groups):
            raise MemorySnapshotRefused(f"the snapshot's optimizer has {len(state['param_groups'])} parameter groups, "
                                        f"this one {len(optimizer.param_groups)}; nothing was changed")
        mesh = mesh_description(tracked.model)
        if self._restored_mesh != mesh:
            raise MemorySnapshotRefused(f"the snapshot of {self.directory} was taken on the mesh {self._restored_mesh}, "
                                        f"this model is sharded on {mesh}; nothing was changed")
        live = {entry.key: entry for entry in layout_of(live_tensors(tracked.model, None))}
        saved = {entry.key: entry for entry in layout if entry.key.startswith("model.")}
        differ = [key for key in saved.keys() | live.keys()
                  if key not in live or key not in saved or (saved[key].shape, saved[key].dtype)
                  != (live[key].shape, live[key].dtype)]
        if differ:
            listed = ", ".join(sorted(differ)[:_MAX_LISTED]) + (" ..." if len(differ) > _MAX_LISTED else "")
            raise MemorySnapshotRefused(f"the snapshot of {self.directory} in host memory is of another model "
                                        f"({len(differ)} tensors differ: {listed}); nothing was changed: "
                                        "`%fsdp2 stop` frees it (or use another directory)")
        params = {f"optim.{fqn}." for fqn, param in tracked.model.named_parameters() if param.requires_grad}
        for entry in layout:
            if entry.key.startswith("optim.") and tracked.optimizer is None:
                raise MemorySnapshotRefused("the snapshot holds optimizer state but no optimizer is tracked; "
                                            "track the optimizer too; nothing was changed")
            if entry.key.startswith("optim.") and not any(entry.key.startswith(prefix) for prefix in params):
                raise MemorySnapshotRefused(f"the snapshot's {entry.key} names no trainable parameter of this "
                                            "model; nothing was changed")

    def _adopt(self, slot: Slot, step: int) -> None:
        """Take the restored slot as this rank's own: the next snapshot goes into the other."""
        index = self._opened_index
        other = self._slots[index]
        if other is not None and other is not slot:
            other.close()
        self._slots[index] = slot
        self._board.set(self.rank, 1 - index, None)  # never written by these ranks: not whole for them
        self._board.set(self.rank, index, step)
        self._written_layouts = [None, None]
        self._write_manifest(None, None, self.manifest.get("mesh", ""))

    def saved_views(self, step: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors of snapshot `step` (views of its slot) and its other state, for writing it to disk."""
        slot, layout, blob = self._open_step(step)
        return {entry.key: slot.view(entry) for entry in layout}, plain_pickle.loads(blob)

    def close(self) -> None:
        """Wait for the copy in flight, then unmap the slots (the store keeps the files)."""
        try:
            self.wait()
        finally:
            self._copier.shutdown(wait=True)
            for slot in self._slots:
                if slot is not None:
                    slot.close()
            self._slots = [None, None]
            self._board.close()


def _other_state(tracked: Tracked, step: int) -> dict[str, Any]:
    """What the snapshot keeps besides tensors, taken now: training replaces these values (the
    scheduler sets a group's lr) but does not change them in place, so copies of the dicts
    suffice; the copy thread serializes them (plain_pickle: plain values and tensors only)."""
    optimizer = tracked.optimizer
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in optimizer.param_groups] if optimizer is not None else []
    return {
        "step": step, "rng": capture_rng_state(), "param_groups": groups,
        "scheduler": dict(tracked.scheduler.state_dict()) if tracked.scheduler is not None else None,
        "extra": {name: copy.deepcopy(obj.state_dict()) for name, obj in tracked.extra.items()},
    }


def _queued_gpu_work(tensors: list[torch.Tensor]) -> torch.cuda.Event | None:
    """An event after the work queued so far on this thread's stream, where the state is on a GPU."""
    if not any(tensor.is_cuda for tensor in tensors):
        return None
    return torch.cuda.current_stream().record_event()


def _copy_back(slot: Slot, layout: list[Entry], tracked: Tracked) -> None:
    """Put the slot's tensors into the live model and optimizer; optimizer state a fresh
    optimizer has not made yet is made like its parameter."""
    live = live_tensors(tracked.model, None)
    params = {fqn: param for fqn, param in tracked.model.named_parameters()}
    optimizer = tracked.optimizer
    with torch.no_grad():
        for entry in layout:
            saved = slot.view(entry)
            if entry.key.startswith("model."):
                local_shard(live[entry.key]).copy_(saved)
                continue
            assert optimizer is not None, "checked before: optimizer state needs an optimizer"
            fqn, _, name = entry.key.removeprefix("optim.").rpartition(".")
            param = params[fqn]
            state = optimizer.state[param]
            current = state.get(name)
            if isinstance(current, torch.Tensor) and tuple(local_shard(current).shape) == entry.shape:
                local_shard(current).copy_(saved)
            else:
                state[name] = _made_like(param, saved, entry)


def _made_like(param: torch.Tensor, saved: torch.Tensor, entry: Entry) -> torch.Tensor:
    device = torch.device("cpu") if entry.on_cpu else local_shard(param).device
    local = saved.to(device=device, copy=True)
    if entry.sharded and isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


def local_rank_range(rank: int) -> range:
    """The ranks of this rank's host, from torchrun's variables (all ranks of one host: together)."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    node = int(os.environ.get("GROUP_RANK", str(rank // max(1, local_world_size))))
    return range(node * local_world_size, (node + 1) * local_world_size)


def store_of_this_rank() -> str | None:
    """The pool's snapshot store (set on every rank), or None outside a pool."""
    return os.environ.get(memory_store.MEMORY_DIR_ENV) or None

