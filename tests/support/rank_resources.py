"""What a rank process holds, read from /proc by the test process: its threads by name and its
open file descriptors by kind. The rank runs nothing to be measured, so measuring changes nothing.

The session model-checker (tests/support/session_model.py) takes a baseline of each rank once the
model is set up on fresh ranks, and checks after every action and at the end of the session that
nothing grew past what legitimately comes and goes (`growth`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
"""The names gloo gives its threads: each device runs one tcp loop and two run loops."""
GLOO_KINDS = ("socket", "pipe", "anon_inode:[eventpoll]")
"""The descriptor kinds of gloo devices and of the rank's own connections and captured output."""

MORE_PLAIN_THREADS = 4
"""A checkpointer makes three single-thread executors on first use and keeps them until it is
closed: the snapshot copier, the async save's thread and the staging copier; while a save writes
its file, the file's stream has a thread of its own."""
REPLACED_CHECKPOINTER_DEVICES = 2
"""A replaced checkpointer's groups (its cells' and its background saves'), until it is freed."""
FDS_PER_GLOO_DEVICE = 5
"""What a replaced gloo device keeps open: measured one socket (its listener or its connection to the
other rank), an epoll and two pipes; one more socket allowed for a connection not closed yet."""
MORE_SNAPSHOT_FILES = 2
"""Snapshots every step keep two slots per rank (the newest whole one and the one being written),
each file held open for its mapping; the board is open from the set-up on."""
MORE_CHECKPOINT_FILES = 1
"""The rank's file of an async save still being written after the cell that asked has ended."""
SETTLE_S = 5.0
"""How long a count above the allowance may take to come back (a thread ending after its cell
replied) before the check fails."""


@dataclass(frozen=True)
class Holdings:
    """One process's threads (by name) and open descriptors (by kind: socket, pipe, an anon_inode,
    or the file's path)."""

    pid: int
    threads: Counter
    fds: Counter

    @property
    def num_threads(self) -> int:
        return sum(self.threads.values())

    @property
    def num_fds(self) -> int:
        return sum(self.fds.values())

    @property
    def gloo_threads(self) -> int:
        return sum(self.threads[name] for name in GLOO_THREADS)

    @property
    def gloo_devices(self) -> int:
        return self.threads["gloo_tcp_loop"]

    def plain_threads(self) -> int:
        return self.num_threads - self.gloo_threads

    def kind_fds(self) -> int:
        return sum(self.fds[kind] for kind in GLOO_KINDS)

    def files_under(self, folder: Path) -> int:
        prefix = f"{folder}/"
        return sum(count for kind, count in self.fds.items() if kind.startswith(prefix))

    def describe(self) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self.fds.items()))
        names = ", ".join(f"{name} {count}" for name, count in sorted(self.threads.items()))
        return f"{self.num_threads} threads ({names}) and {self.num_fds} fds ({kinds})"


def fd_kind(target: str) -> str:
    """'socket:[123]' -> 'socket', 'pipe:[45]' -> 'pipe'; anything else (a path, an anon_inode) as is."""
    for kind in ("socket", "pipe"):
        if target.startswith(f"{kind}:["):
            return kind
    return target


def read_holdings(pid: int) -> Holdings | None:
    """The process's threads and descriptors now; None when it is gone."""
    try:
        thread_ids = os.listdir(f"/proc/{pid}/task")
        fd_names = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError):
        return None
    threads: Counter = Counter()
    for thread_id in thread_ids:
        try:
            threads[Path(f"/proc/{pid}/task/{thread_id}/comm").read_text().strip()] += 1
        except OSError:  # the thread ended while we read
            continue
    fds: Counter = Counter()
    for fd in fd_names:
        try:
            fds[fd_kind(os.readlink(f"/proc/{pid}/fd/{fd}"))] += 1
        except OSError:  # closed while we read
            continue
    return Holdings(pid, threads, fds)


def growth(baseline: Holdings, now: Holdings, *, snapshot_dir: Path, ckpt_dir: Path) -> list[str]:
    """How `now` exceeds what may have come since `baseline`; empty when within the allowance.

    Gloo devices, measured never to add up over repeated cycles: each re-formable group keeps the
    backend it was made with registered for torch's device checks (fsdp2nb/worker/reformable_groups.py),
    so after its first re-forming it holds one device more (every device at set-up is such a group's
    but the checkpointer's background group); and a checkpointer made anew (`track()` again) leaves
    the old one's two groups open until the next `%fsdp2 load` or the garbage collector lets it go."""
    extra_devices = max(baseline.gloo_devices - 1, 0) + REPLACED_CHECKPOINTER_DEVICES
    threads_per_device = baseline.gloo_threads // baseline.gloo_devices if baseline.gloo_devices else 0
    allowed_gloo_threads = baseline.gloo_threads + threads_per_device * extra_devices
    exceeded = []
    if now.gloo_threads > allowed_gloo_threads:
        exceeded.append(f"gloo threads {baseline.gloo_threads} -> {now.gloo_threads} (allowed {allowed_gloo_threads})")
    if now.plain_threads() > baseline.plain_threads() + MORE_PLAIN_THREADS:
        exceeded.append(f"other threads {baseline.plain_threads()} -> {now.plain_threads()} "
                        f"(allowed {baseline.plain_threads() + MORE_PLAIN_THREADS})")
    allowed_fds = baseline.kind_fds() + FDS_PER_GLOO_DEVICE * extra_devices
    if now.kind_fds() > allowed_fds:
        exceeded.append(f"sockets, pipes and epolls {baseline.kind_fds()} -> {now.kind_fds()} (allowed {allowed_fds})")
    for folder, more, what in ((snapshot_dir, MORE_SNAPSHOT_FILES, "snapshot files"),
                               (ckpt_dir, MORE_CHECKPOINT_FILES, "checkpoint files")):
        if now.files_under(folder) > baseline.files_under(folder) + more:
            exceeded.append(f"{what} {baseline.files_under(folder)} -> {now.files_under(folder)} "
                            f"(allowed {baseline.files_under(folder) + more})")
    other_files = now.num_fds - now.kind_fds() - now.files_under(snapshot_dir) - now.files_under(ckpt_dir)
    baseline_other = (baseline.num_fds - baseline.kind_fds() - baseline.files_under(snapshot_dir)
                      - baseline.files_under(ckpt_dir))
    if other_files > baseline_other:
        exceeded.append(f"other files {baseline_other} -> {other_files} (allowed {baseline_other})")
    return exceeded


def settled_growth(baseline: Holdings, *, snapshot_dir: Path, ckpt_dir: Path) -> tuple[Holdings | None, list[str]]:
    """The process's holdings and their growth, read again for up to `SETTLE_S` while they exceed
    the allowance; (None, []) once the process is gone."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = read_holdings(baseline.pid)
        if now is None:
            return None, []
        exceeded = growth(baseline, now, snapshot_dir=snapshot_dir, ckpt_dir=ckpt_dir)
        if not exceeded or time.monotonic() > deadline:
            return now, exceeded
        time.sleep(0.1)
