"""What the kernel, the host agent and the ranks of a kept pool share through its directory.

A kept pool (`%fsdp2 start --keep`) outlives its kernel. Its directory (0700, under the user's
state directory) holds:
- `key` (0600): the pool's HMAC key; whoever can read it may attach, as only this user can;
- `attach`: the signed `AttachRecord` naming the holding kernel and its socket, in the envelope
  that carries its writer's wire version (wire/versions.py). A kernel that attaches first reads
  the version there and refuses a pool of another version; else it writes its own record, then
  wakes the agent (SIGUSR1), which wakes its ranks; each reads the record, checks its signature,
  version and serial, and reconnects through the usual admission (a fresh challenge per
  connection);
- `activity`: one fixed-size slot per rank, written by the rank through a shared mapping (a
  store to memory, no system call per cell): the request it runs, the last one it ran, when
  that changed, and whether it waits at a prompt. The agent's keep-for clock, `%fsdp2 pools`
  and a kernel that attaches read it;
- `exited-R`: the signed exit report of rank R, written by the agent when the rank died while
  no kernel held the pool (the others run on; the kernel that attaches reports it);
- `pool.json`: what `%fsdp2 pools` and `attach` need (spec, pids, log directory), written by
  the kernel that starts the pool;
- `run/`: the pool's runtime directory (the process group's FileStore), which no kernel owns.

A pool across hosts (Ray) keeps these files on the kernel's host, and each host's agent and ranks
use a directory of their own, `node-N/` under the same path on their host, holding a copy of the
attach record and that host's activity board (pool/ray_driver.py keeps them up to date).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass

from fsdp2nb.atomic_files import replace_atomically
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.versions import Opened

KEY_FILE = "key"
RECORD_FILE = "attach"
ACTIVITY_FILE = "activity"
META_FILE = "pool.json"
RUN_DIR = "run"

_SLOT = struct.Struct("<qqqdq")
"""Per rank: the request running (-1: none), its execution count, the last request taken, when
that changed (time.time()), and whether its main thread waits at a prompt (1) or not (0)."""
_WAITING = struct.Struct("<q")
_WAITING_OFFSET = _SLOT.size - _WAITING.size
_EXIT_PREFIX = "exited-"
SLOT_BYTES = _SLOT.size


def host_kept_dir(kept_dir: str, node: int, multi_host: bool) -> str:
    """The directory the agent and ranks of `node` use: the pool's own on one host, `node-N/`
    inside it (on that host's filesystem) across hosts."""
    return os.path.join(kept_dir, f"node-{node}") if multi_host else kept_dir


def write_attach_record(kept_dir: str, signer: Signer, record: AttachRecord) -> None:
    """Replace the record atomically: a reader sees the old one or the new one, whole."""
    replace_atomically(os.path.join(kept_dir, RECORD_FILE), signer.pack_versioned(record), private=True)


def read_attach_record(kept_dir: str, signer: Signer) -> AttachRecord | None:
    """The record if its signature verifies under `signer`'s key and it speaks this end's wire
    version; None otherwise (or none yet)."""
    opened = read_attach_envelope(kept_dir, signer)
    return opened.message if opened is not None and isinstance(opened.message, AttachRecord) else None


def read_attach_envelope(kept_dir: str, signer: Signer) -> Opened | None:
    """The record as written, with its writer's wire version (its message None where that is
    not this end's); None where there is none or its signature fails."""
    try:
        with open(os.path.join(kept_dir, RECORD_FILE), "rb") as record_file:
            frame = record_file.read(64 * 1024)
    except OSError:
        return None
    return signer.open_versioned(frame)


def decode_attach_record(signer: Signer, frame: bytes) -> AttachRecord | None:
    """A record's file content, as `read_attach_record` reads it."""
    opened = signer.open_versioned(frame)
    return opened.message if opened is not None and isinstance(opened.message, AttachRecord) else None


@dataclass(frozen=True, slots=True)
class RankWork:
    """What one rank of a kept pool runs, as its activity slot says."""

    running_cell_id: int | None
    execution_count: int | None
    last_cell_id: int
    since: float
    """When the rank last started or ended a request (or joined the pool)."""
    waiting_for_input: bool = False
    """Its main thread waits at input(), getpass or a debugger prompt."""


def create_activity_board(kept_dir: str, world_size: int) -> None:
    """Every rank idle since now; made by the kernel before the agent starts."""
    now = time.time()
    fd = os.open(os.path.join(kept_dir, ACTIVITY_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as board:
        board.write(b"".join(_SLOT.pack(-1, -1, 0, now, 0) for _ in range(world_size)))


def read_activity(kept_dir: str) -> list[RankWork]:
    """Every rank's slot (empty when the board is missing)."""
    try:
        with open(os.path.join(kept_dir, ACTIVITY_FILE), "rb") as board:
            data = board.read()
    except OSError:
        return []
    slots = (_SLOT.unpack_from(data, offset) for offset in range(0, len(data) - _SLOT.size + 1, _SLOT.size))
    return [RankWork(running if running >= 0 else None, count if count >= 0 else None, last, since, bool(waiting))
            for running, count, last, since, waiting in slots]


class ActivitySlot:
    """A rank's own slot, written through a shared mapping of the board."""

    def __init__(self, kept_dir: str, rank: int) -> None:
        fd = os.open(os.path.join(kept_dir, ACTIVITY_FILE), os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._offset = rank * _SLOT.size
        self._last_cell_id = 0

    def started(self, cell_id: int, execution_count: int | None) -> None:
        self._last_cell_id = max(self._last_cell_id, cell_id)
        _SLOT.pack_into(self._map, self._offset, cell_id, -1 if execution_count is None else execution_count,
                        self._last_cell_id, time.time(), 0)

    def ended(self) -> None:
        _SLOT.pack_into(self._map, self._offset, -1, -1, self._last_cell_id, time.time(), 0)

    def waiting_for_input(self, waiting: bool) -> None:
        _WAITING.pack_into(self._map, self._offset + _WAITING_OFFSET, int(waiting))


def mark_rank_ended(kept_dir: str, rank: int) -> None:
    """The agent's note that a dead rank runs nothing (else the pool would look busy forever)."""
    with open(os.path.join(kept_dir, ACTIVITY_FILE), "r+b") as board:
        board.seek(rank * _SLOT.size)
        slot = board.read(_SLOT.size)
        if len(slot) < _SLOT.size:
            return
        last_cell_id = _SLOT.unpack(slot)[2]
        board.seek(rank * _SLOT.size)
        board.write(_SLOT.pack(-1, -1, last_cell_id, time.time(), 0))


def write_exit_report(kept_dir: str, signer: Signer, report: RankExited) -> None:
    """Keep a rank's exit report for the next kernel (written by the agent, signed, 0600)."""
    replace_atomically(os.path.join(kept_dir, f"{_EXIT_PREFIX}{report.rank}"), signer.pack(report), private=True)


def read_exit_reports(kept_dir: str, signer: Signer) -> dict[int, RankExited]:
    """Rank -> its exit report, for the ranks that died while no kernel held the pool."""
    reports = {}
    for name in sorted(os.listdir(kept_dir)) if os.path.isdir(kept_dir) else ():
        if not name.startswith(_EXIT_PREFIX) or name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(kept_dir, name), "rb") as report_file:
                report = signer.unpack(report_file.read(1 << 20))
        except OSError:
            continue
        if isinstance(report, RankExited):
            reports[report.rank] = report
    return reports


def pool_is_idle_since(kept_dir: str) -> float | None:
    """When the last rank ended its request; None while one runs (or the board is unreadable)."""
    work = read_activity(kept_dir)
    if not work or any(slot.running_cell_id is not None for slot in work):
        return None
    return max(slot.since for slot in work)
