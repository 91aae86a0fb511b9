"""The store of in-memory snapshots of training state: where they live, their files, what their
manifests and board say, and who removes them (no torch).

A snapshot store is a directory on a tmpfs (`/dev/shm`, or `FSDP2NB_SHARED_MEMORY_DIR`): its files
are host memory that outlives the processes that wrote them, so a rank killed by the OOM killer,
a dead host agent or a restarted pool leaves the last snapshot for the next ranks to restore.
Each store belongs to one kernel's session (`session-PID-START`) or to one kept pool (`kept-NAME`),
and inside it each Checkpointer directory has its own folder of per-rank files:

    rank-00000.json         the manifest: the rank, world size, mesh and each slot's tensor layout
                            (replaced whole, when a slot is made or its layout changes)
    rank-00000.slot0/1      the tensors of a slot, at the offsets the layout gives
    rank-00000.slot0/1.state  the rank's other state (RNG, scheduler, step; checkpoint/plain_pickle.py)
    board                   per rank and slot, the step the slot holds whole (an int64, step + 1;
                            0 while it is written): one store per snapshot, no file written

The same rules hold on every host, whoever makes the folders (the kernel, or a rank on another
host): folders are 0700, owned by this user and not links, or refused in one line; files are
0600, opened without following links, and replaced through a fresh random name opened exclusively
(atomic_files.py). A slot's room is reserved when its file is made, so a full tmpfs fails then,
not as a SIGBUS in the middle of a copy.

The kernel reads the manifests (which step is kept, how big) for `%fsdp2 status` and for the note
after a restart; the ranks map the slots and the board and write and restore the slots
(checkpoint/memory_snapshots.py). Whoever
ends the owner removes the store: `%fsdp2 stop` and the kernel's exit, a kept pool's end, the host
agent when its kernel is gone, and the reaper for a store whose kernel or kept pool no longer exists.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp2nb.atomic_files import create_atomically, replace_atomically
from fsdp2nb.errors import MemorySnapshotRefused, UnsafeDirectory

MEMORY_DIR_ENV = "FSDP2NB_MEMORY_DIR"
"""Set on every rank of a pool: the store its Checkpointers keep snapshots in."""
SHARED_MEMORY_DIR_ENV = "FSDP2NB_SHARED_MEMORY_DIR"
"""Another tmpfs instead of /dev/shm (a container whose /dev/shm is 64 MB)."""
MANIFEST_VERSION = 2


def shared_memory_dir() -> str:
    return os.environ.get(SHARED_MEMORY_DIR_ENV) or "/dev/shm"


def stores_root() -> Path:
    """This user's directory of snapshot stores (0700), made on first use."""
    return private_folder(Path(shared_memory_dir()) / f"fsdp2nb-snapshots-{os.getuid()}")


def private_folder(path: Path) -> Path:
    """`path`, made 0700 if missing; refused (`UnsafeDirectory`) unless it is a directory, not a
    link, owned by this user. Another user can make a name first in a shared tmpfs, or plant a
    link to where a rank would write the weights; a folder of ours that others may enter is
    closed to them."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _unsafe(path, "a link or not a directory") from exc
    try:
        info = os.fstat(descriptor)
        if info.st_uid != os.getuid():
            raise _unsafe(path, f"owned by uid {info.st_uid}, not by this user (uid {os.getuid()})")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(descriptor, 0o700)
    finally:
        os.close(descriptor)
    return path


def _unsafe(path: Path, what: str) -> UnsafeDirectory:
    return UnsafeDirectory(f"the snapshot store's {path} is {what}; nothing was written: remove it (or set "
                           f"{SHARED_MEMORY_DIR_ENV} to a tmpfs of your own) and run the cell again")


def open_checkpointer_folder(store: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """`checkpointer_folder`, with the store and the folder above it made or checked as
    `private_folder` does (on a host other than the kernel's, a rank makes them)."""
    private_folder(Path(store).parent)
    private_folder(Path(store))
    return private_folder(checkpointer_folder(store, directory))


def write_private_file(path: Path, data: bytes) -> None:
    """Replace `path` whole with `data` (0600)."""
    replace_atomically(path, data, private=True)


def read_private_file(path: Path) -> bytes:
    """`path`'s bytes; a link is refused (OSError), not followed."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as file:
        return file.read()


def session_store(pid: int, start_time: float) -> Path:
    """The store of the kernel (pid, start time after boot: host/process_identity.py): its pools'
    snapshots survive their restarts."""
    return stores_root() / f"session-{pid}-{int(start_time * 1000)}"


def kept_store(name: str) -> Path:
    """The store of the kept pool `name`: it outlives the kernels that hold the pool."""
    return stores_root() / f"kept-{name}"


OWNER_FILE = "owner"
"""In a kept pool's store: the path of the pool's directory, which lives exactly as long as the
pool. The name alone would not do: kernels with another TMPDIR keep their pools elsewhere."""


def mark_owner(store: Path, pool_dir: str | os.PathLike) -> None:
    """Make `store` (0700) and record that it belongs to the kept pool in `pool_dir`."""
    private_folder(store)
    write_private_file(store / OWNER_FILE, str(pool_dir).encode())


def checkpointer_folder(store: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """Where the snapshots of the Checkpointer of `directory` live in `store`."""
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:16]
    return Path(store) / digest


def manifest_path(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank:05d}.json"


def slot_path(folder: Path, rank: int, slot: int) -> Path:
    return folder / f"rank-{rank:05d}.slot{slot}"


def state_path(folder: Path, rank: int, slot: int) -> Path:
    """The rank's other state that goes with the slot's tensors."""
    return folder / f"rank-{rank:05d}.slot{slot}.state"


def board_path(folder: Path) -> Path:
    return folder / "board"


def write_manifest(folder: Path, rank: int, manifest: dict[str, Any]) -> None:
    """Replace the rank's manifest whole: a reader sees the old one or the new one."""
    write_private_file(manifest_path(folder, rank), json.dumps(manifest).encode())


def read_manifest(folder: Path, rank: int) -> dict[str, Any] | None:
    """The rank's manifest, or None if it has none or it cannot be read."""
    return _read_json(manifest_path(folder, rank))


def read_board(folder: Path, world_size: int) -> list[tuple[int, int]]:
    """Per rank, the step held whole in each of its two slots (-1: none, or being written), read
    without mapping the board (the kernel's view; the ranks map it: `Board`)."""
    try:
        raw = read_private_file(board_path(folder))
    except OSError:
        raw = b""
    raw = raw[:_board_bytes(world_size)].ljust(_board_bytes(world_size), b"\0")
    values = struct.unpack(f"<{2 * world_size}q", raw)
    return [(values[2 * rank] - 1, values[2 * rank + 1] - 1) for rank in range(world_size)]


def _board_bytes(world_size: int) -> int:
    return 16 * world_size  # an int64 per rank and slot


class Board:
    """The board mapped into a rank, shared with the ranks of its host: per rank and slot an
    int64, step + 1 (a new file is zeros: 0 means none, or being written; -(step + 1): that
    step's copy failed)."""

    def __init__(self, folder: Path, world_size: int) -> None:
        self._map = shared_mapped_file(board_path(folder), _board_bytes(world_size))
        self._steps = memoryview(self._map).cast("q")

    def get(self, rank: int, slot: int) -> int:
        """The step, or -1."""
        return self._steps[2 * rank + slot] - 1

    def newest(self, rank: int) -> int:
        return max(self.get(rank, 0), self.get(rank, 1))

    def set(self, rank: int, slot: int, step: int | None) -> None:
        self._steps[2 * rank + slot] = 0 if step is None else step + 1

    def mark_failed(self, rank: int, slot: int, step: int) -> None:
        """The copy of `step` into the slot failed: neither whole nor still coming (negative)."""
        self._steps[2 * rank + slot] = -(step + 1)

    def clear_failed(self, rank: int) -> None:
        """Every rank has heard of the rank's failed copy: mark its slot as being written again."""
        for index in (2 * rank, 2 * rank + 1):
            if self._steps[index] < 0:
                self._steps[index] = 0

    def failed_step(self, rank: int) -> int:
        """The step of the rank's last failed copy still marked, or -1."""
        return max(-value - 1 if value < 0 else -1 for value in self._steps[2 * rank:2 * rank + 2])

    def close(self) -> None:
        self._steps.release()
        self._map.close()


_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def new_mapped_file(path: Path, num_bytes: int) -> mmap.mmap | None:
    """A fresh file of `num_bytes` at `path` (replacing what was there), mapped shared; None for no bytes."""
    replace_atomically(path, private=True, num_reserved_bytes=num_bytes)
    return _mapped(_checked(os.open(path, _OPEN_FLAGS), path), path, num_bytes)


def existing_mapped_file(path: Path, num_bytes: int) -> mmap.mmap | None:
    """The file at `path` (a link refused), mapped shared; None for no bytes."""
    return _mapped(_checked(os.open(path, _OPEN_FLAGS), path), path, num_bytes)


def shared_mapped_file(path: Path, num_bytes: int) -> mmap.mmap:
    """The file at `path` that the ranks of a host share, made by whichever comes first."""
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        create_atomically(path, private=True, num_reserved_bytes=num_bytes)  # or another rank's, made meanwhile
        descriptor = os.open(path, _OPEN_FLAGS)
    mapped = _mapped(_checked(descriptor, path), path, num_bytes, grow=True)  # a larger world than the last
    assert mapped is not None, "a shared file has bytes"
    return mapped


def _checked(descriptor: int, path: Path) -> int:
    """`descriptor`, if it is a regular file of this user's; else closed and refused."""
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(descriptor)
        raise UnsafeDirectory(f"the snapshot store's {path} is not a file of this user's; nothing was written: "
                              "remove it and run the cell again")
    return descriptor


def _mapped(descriptor: int, path: Path, num_bytes: int, *, grow: bool = False) -> mmap.mmap | None:
    try:
        if grow and os.fstat(descriptor).st_size < num_bytes:
            os.posix_fallocate(descriptor, 0, num_bytes)
        if os.fstat(descriptor).st_size < num_bytes:
            raise MemorySnapshotRefused(f"{path} holds fewer than the {num_bytes} bytes its manifest gives")
        return mmap.mmap(descriptor, num_bytes) if num_bytes else None
    finally:
        os.close(descriptor)


def tmpfs_free(folder: Path) -> int:
    """The bytes the store's tmpfs has free (0 where it cannot be asked)."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def complete_steps(manifest: dict[str, Any], board: list[tuple[int, int]]) -> dict[int, int]:
    """Step -> slot of each snapshot the manifest's rank holds whole."""
    rank, layouts = manifest.get("rank", -1), manifest.get("layouts") or [None, None]
    if not 0 <= rank < len(board):
        return {}
    return {step: slot for slot, step in enumerate(board[rank]) if step >= 0 and layouts[slot] is not None}


@dataclass(frozen=True, slots=True)
class KeptSnapshot:
    """The newest snapshot of one Checkpointer that every rank of this host holds."""

    directory: str
    """The Checkpointer's directory."""
    step: int
    world_size: int
    num_ranks_here: int
    num_bytes: int
    """Host memory the store's files of this Checkpointer take (both slots of every rank here)."""

    def describe(self) -> str:
        from fsdp2nb.sizes import size

        return f"step {self.step} of {self.directory} ({size(self.num_bytes)} of host memory)"


def kept_snapshots(store: str | os.PathLike | None) -> list[KeptSnapshot]:
    """What `store` holds, one entry per Checkpointer with a step complete on every rank here."""
    if not store or not Path(store).is_dir():
        return []
    found = []
    for folder in sorted(Path(store).iterdir()):
        snapshot = _newest_common(folder)
        if snapshot is not None:
            found.append(snapshot)
    return found


def _newest_common(folder: Path) -> KeptSnapshot | None:
    manifests = [m for path in folder.glob("rank-*.json") if (m := _read_json(path)) is not None]
    if not manifests:
        return None
    world_size = manifests[0].get("world_size", len(manifests))
    if len(manifests) < manifests[0].get("local_world_size", 1):
        return None
    board = read_board(folder, world_size)
    common = set.intersection(*(set(complete_steps(manifest, board)) for manifest in manifests))
    if not common:
        return None
    num_bytes = sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
    return KeptSnapshot(directory=manifests[0].get("directory", "?"), step=max(common), world_size=world_size,
                        num_ranks_here=len(manifests), num_bytes=num_bytes)


def _read_text(path: Path) -> str | None:
    try:
        return read_private_file(path).decode()
    except (OSError, ValueError):
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(read_private_file(path))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("version") == MANIFEST_VERSION else None


def remove_store(store: str | os.PathLike | None) -> None:
    """Free a store's memory; safe to call twice."""
    if store:
        shutil.rmtree(store, ignore_errors=True)


def sweep_stores(session_alive: Callable[[int, float], bool], spare: str = "") -> int:
    """Remove the stores whose kernel has ended or whose kept pool is gone, but `spare`; returns
    how many. A kept pool's store that names no pool directory is left alone."""
    removed = 0
    try:
        stores = list(stores_root().iterdir())
    except (OSError, RuntimeError):
        return 0
    for store in stores:
        kind, _, rest = store.name.partition("-")
        if kind == "session":
            pid, _, millis = rest.partition("-")
            orphaned = not (pid.isdigit() and millis.isdigit() and session_alive(int(pid), int(millis) / 1000))
        elif kind == "kept":
            owner = _read_text(store / OWNER_FILE)
            orphaned = owner is not None and not os.path.isdir(owner)
        else:
            continue
        if orphaned and str(store) != spare:
            remove_store(store)
            removed += 1
    return removed
