"""A rank's two slots of one Checkpointer's snapshots in host memory: their files mapped as
tensors, and which step each holds whole.

A slot is one file of the store (host/memory_store.py), filled at the offsets its layout gives
(snapshot_layout.py), with the rank's other state in a small file beside it. The store's board
says, per rank and slot, the step the slot holds whole, and the rank's manifest each slot's
layout. The slot written next is never the one that holds the newest complete step, and a slot is
replaced only once every rank of the host holds the newest step (memory_snapshots.py says why).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp2nb.checkpoint.snapshot_layout import Entry, layout_bytes
from fsdp2nb.errors import MemorySnapshotRefused
from fsdp2nb.host import memory_store
from fsdp2nb.host.memory_store import MANIFEST_VERSION, Board, complete_steps, read_board

_PEER_POLL_S = 0.0005
_PEER_WAIT_S = 120.0
"""How long a copy waits for a neighbour's previous one; past it the neighbour is stuck or failed
(its own error says why) and this snapshot is given up rather than spin on."""


class Slot:
    """One slot file mapped into this process."""

    def __init__(self, path: Path, num_bytes: int, *, fresh: bool) -> None:
        """`fresh`: a new file replaces what `path` held; else the file there is mapped."""
        self.path, self.num_bytes = path, num_bytes
        mapped = memory_store.new_mapped_file if fresh else memory_store.existing_mapped_file
        self._map = mapped(path, num_bytes)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else \
            torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self._views: tuple[list[Entry], list[torch.Tensor]] | None = None

    def views(self, layout: list[Entry]) -> list[torch.Tensor]:
        """A view of the slot per entry of `layout`, made once per layout (a copy reuses them)."""
        if self._views is None or self._views[0] is not layout:
            self._views = (layout, [self.view(entry) for entry in layout])
        return self._views[1]

    def view(self, entry: Entry) -> torch.Tensor:
        raw = self.bytes[entry.offset:entry.offset + entry.num_bytes]
        return raw.view(getattr(torch, entry.dtype)).view(entry.shape)

    def pin(self) -> None:
        """Page-lock the slot for the GPU's copies (cudaHostRegister), once."""
        if not self.pinned and self.num_bytes:  # where it fails, the copies are synchronous instead
            error = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.num_bytes, 0)
            self.pinned = int(error) == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
        self.bytes = torch.empty(0, dtype=torch.uint8)
        self._views = None
        try:
            if self._map is not None:
                self._map.close()
        except BufferError:  # a view handed out is still alive: the mapping goes with it
            pass


@dataclass(frozen=True, slots=True)
class StoredStep:
    """A step as this rank holds it in a slot, read back for a restore or a save to disk."""

    index: int
    """Which of the two slots."""
    slot: Slot
    layout: list[Entry]
    state: bytes
    """The rank's other state, as pickled."""
    mesh: str | None
    """The mesh it was taken on, as its manifest says."""


class RankSlots:
    """This rank's two slots of one Checkpointer's folder in the store, with the board and its manifest."""

    def __init__(self, folder: Path, directory: str, *, rank: int, world_size: int, local_ranks: range) -> None:
        self.folder, self.directory = folder, directory
        self.rank, self.world_size, self.local_ranks = rank, world_size, local_ranks
        self.slots: list[Slot | None] = [None, None]
        self.board = Board(folder, world_size)
        self.manifest: dict[str, Any] = memory_store.read_manifest(folder, rank) or {}
        self._written_layouts: list[list[Entry] | None] = [None, None]
        """The layout objects the manifest holds for each slot as written by this process."""

    def newest_step(self) -> int | None:
        """The newest step this rank holds whole (another thread may read it while a copy runs)."""
        newest = self.board.newest(self.rank)
        return newest if newest >= 0 else None

    def slot_to_write(self) -> int:
        """The slot that does not hold the newest complete snapshot."""
        first, second = self.board.get(self.rank, 0), self.board.get(self.rank, 1)
        return 0 if first < second else 1

    def give_up(self) -> None:
        """Mark both slots as holding no step whole."""
        self.board.set(self.rank, 0, None)
        self.board.set(self.rank, 1, None)

    def replace(self, index: int, num_bytes: int) -> None:
        """A fresh file of `num_bytes` for slot `index`, once the host's ranks hold the newest step."""
        previous = self.newest_step()
        if previous is not None:
            self.wait_for_neighbours(previous)
        self.board.set(self.rank, index, None)  # before its file changes
        old = self.slots[index]
        self.slots[index] = None
        if old is not None:
            old.close()
        self.slots[index] = Slot(memory_store.slot_path(self.folder, self.rank, index), num_bytes, fresh=True)

    def wait_for_neighbours(self, step: int) -> bool:
        """Until every rank of this host holds `step` (see memory_snapshots.py); False at once where
        a neighbour's copy of it failed (that rank reports it)."""
        deadline = time.monotonic() + _PEER_WAIT_S
        while behind := [rank for rank in self.local_ranks if self.board.newest(rank) < step]:
            if any(self.board.failed_step(rank) >= step for rank in behind):
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: rank {behind[0]} did not finish its snapshot of step {step} "  # internal: a neighbour's failure; the snapshot is given up, not the user's input
                                   f"in {_PEER_WAIT_S:.0f} s; this snapshot was given up, the previous one is whole")
            time.sleep(_PEER_POLL_S)
        return True

    def record_layout(self, index: int, layout: list[Entry], mesh: str) -> None:
        """Give slot `index` this layout in the manifest, unless it has it already."""
        if self._written_layouts[index] is not layout or self.manifest.get("mesh") != mesh:
            self._write_manifest(index, layout, mesh)

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

    def complete_steps(self, manifest: dict[str, Any]) -> dict[int, int]:
        return complete_steps(manifest, read_board(self.folder, self.world_size))

    def read(self, step: int) -> StoredStep:
        """Step `step` as this rank holds it (KeyError if it holds it in no slot)."""
        manifest = memory_store.read_manifest(self.folder, self.rank)
        if manifest is None:
            raise MemorySnapshotRefused(f"rank {self.rank} has no snapshot manifest in {self.folder}")
        index = self.complete_steps(manifest)[step]
        layout = [Entry.from_json(row) for row in manifest["layouts"][index]]
        state = memory_store.read_private_file(memory_store.state_path(self.folder, self.rank, index))
        slot = self.slots[index]
        if slot is None or slot.num_bytes != layout_bytes(layout):
            slot = Slot(memory_store.slot_path(self.folder, self.rank, index), layout_bytes(layout), fresh=False)
        self.manifest = manifest
        return StoredStep(index, slot, layout, state, manifest.get("mesh"))

    def adopt(self, stored: StoredStep, step: int) -> None:
        """Take a restored slot as this rank's own: the next snapshot goes into the other."""
        other = self.slots[stored.index]
        if other is not None and other is not stored.slot:
            other.close()
        self.slots[stored.index] = stored.slot
        self.board.set(self.rank, 1 - stored.index, None)  # never written by these ranks: not whole for them
        self.board.set(self.rank, stored.index, step)
        self._written_layouts = [None, None]
        self._write_manifest(None, None, self.manifest.get("mesh", ""))

    def close(self) -> None:
        """Unmap the slots and the board (the store keeps the files)."""
        for slot in self.slots:
            if slot is not None:
                slot.close()
        self.slots = [None, None]
        self.board.close()
