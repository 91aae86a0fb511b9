"""A kept pool's ranks and agent: they outlive their kernel and follow the next one that attaches.

The kernel that attaches writes a signed `AttachRecord` into the pool's directory (pool/kept/directory.py)
and sends the agent SIGUSR1. The agent reads the record, reconnects its own events connection,
starts watching the new holder's pid, and writes a byte into each rank's wake pipe. A rank's
control thread sleeps on that pipe and its control connection; woken, it reads the record and,
if it is newer than the last it followed and names a socket, reconnects all three connections
through admission (a fresh challenge each). The rank's main thread, which met the end of its
old requests connection (or is busy with a background run), then goes on with the new ones.

The agent of a kept pool does not end its ranks with the kernel; it ends them when no kernel
has held the pool and no rank has run anything for `keep_for_s` (a running request, a
background run, stops that clock; it starts again when the run ends). A rank that dies while
no kernel holds the pool does not end the others: the agent keeps its exit report in the
pool's directory, and the kernel that attaches says which rank died and how.

Across hosts (Ray) an agent cannot see the holding kernel's pid: the Ray driver, on the kernel's
host, watches it and writes each new record into every host's directory (pool/ray_driver.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import sys
import time
from collections.abc import Callable

from fsdp2nb.pool.kept.directory import (
    META_FILE,
    mark_rank_ended,
    pool_is_idle_since,
    read_attach_envelope,
    read_attach_record,
    write_attach_record,
    write_exit_report,
)
from fsdp2nb.wire.channels import RankChannels
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.launch_plan import LaunchPlan
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.versions import ours

_BUSY_RECHECK_S = 5.0
"""While no kernel holds the pool and a rank runs something, how often the agent looks again
whether it ended (the keep-for clock starts then)."""


class RankFollower:
    """A kept rank's control-thread side: control messages, and reconnecting when woken."""

    def __init__(self, channels: RankChannels, signer: Signer, kept_dir: str, wake_fd: int,
                 on_reconnected: Callable[[], None]) -> None:
        self._channels = channels
        self._signer = signer
        self._kept_dir = kept_dir
        self._wake_fd = wake_fd
        self._on_reconnected = on_reconnected
        record = read_attach_record(kept_dir, signer)
        self._serial = record.serial if record is not None else 0
        self._ended_generation = -1
        """The generation whose control connection reached its end (no kernel to read from)."""

    def receive_control(self) -> object | None:
        """The next control message; None after a wake-up. EOFError once the agent is gone."""
        while True:
            generation = self._channels.generation
            poller = select.poll()
            poller.register(self._wake_fd, select.POLLIN)
            if generation != self._ended_generation:
                poller.register(self._channels.control_fileno(), select.POLLIN)
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_fd in ready:
                self._woken()
                return None
            try:
                return self._channels.receive_control(0)
            except (EOFError, OSError):
                self._ended_generation = generation  # detached: only a wake-up can bring a kernel

    def _woken(self) -> None:
        if not _drain(self._wake_fd):
            raise EOFError("the host agent is gone")
        record = _followed_record(self._kept_dir, self._signer, "fsdp2nb")
        if record is None or record.serial <= self._serial:
            return
        self._serial = record.serial
        if not record.address:
            return  # a kernel let go; the next one wakes us again
        try:
            self._channels.reconnect(record.address)
        except OSError as error:
            print(f"fsdp2nb: {error}", file=sys.stderr)  # to the rank's log
            return
        self._on_reconnected()


class AgentKeeper:
    """A kept pool's agent side: who holds the pool, waking the ranks, and the keep-for clock."""

    def __init__(self, plan: LaunchPlan, signer: Signer, channels: RankChannels, directory: str) -> None:
        self.plan = plan
        self.directory = directory
        """This host's kept directory (pool/kept/directory.py: host_kept_dir)."""
        self.watches_holder = not plan.multi_host
        """Whether the holder's pid is a process of this host, which the agent watches."""
        self._signer = signer
        self._channels = channels
        self.wake_fds: list[int] = []
        """The write ends of the ranks' wake pipes."""
        record = read_attach_record(directory, signer)
        self._serial = record.serial if record is not None else 0
        self.holder_pid: int | None = record.holder_pid if record is not None and record.holder_pid else None
        self.detached_since: float | None = None if self.holder_pid else time.time()

    def holder_ended(self) -> None:
        """The holding kernel is gone (its pidfd said so): write that no kernel holds the pool,
        unless another took it meanwhile, so that `%fsdp2 pools` says since when."""
        ended, self.holder_pid = self.holder_pid, None
        self.detached_since = time.time()
        lock = os.open(os.path.join(self.directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            record = read_attach_record(self.directory, self._signer)
            if record is not None and record.holder_pid == ended:
                detached = AttachRecord(serial=record.serial + 1, address="", holder_pid=0,
                                        holder_start_time=0.0, since=self.detached_since)
                write_attach_record(self.directory, self._signer, detached)
                self._serial = detached.serial
        except OSError as error:
            print(f"fsdp2nb agent: could not note the kernel's end: {error}", file=sys.stderr, flush=True)
        finally:
            os.close(lock)

    def rank_died(self, report: RankExited) -> None:
        """A rank died and no kernel heard of it: keep its report for the next kernel, and mark
        it idle (the keep-for clock would otherwise wait for a request it never ends)."""
        print(f"fsdp2nb agent: rank {report.rank} (pid {report.pid}) ended while no kernel held the pool; "
              "the other ranks run on", flush=True)
        try:
            write_exit_report(self.directory, self._signer, report)
            mark_rank_ended(self.directory, report.rank)
        except OSError as error:
            print(f"fsdp2nb agent: could not keep rank {report.rank}'s exit report: {error}", file=sys.stderr,
                  flush=True)

    def follow_record(self) -> bool:
        """Take a newer attach record into account; returns whether the holder changed."""
        record = _followed_record(self.directory, self._signer, "fsdp2nb agent")
        if record is None or record.serial <= self._serial:
            return False
        self._serial = record.serial
        self.holder_pid = record.holder_pid or None
        self.detached_since = None if self.holder_pid else record.since
        if record.address:
            try:
                self._channels.reconnect(record.address)
            except OSError as error:
                print(f"fsdp2nb agent: {error}", file=sys.stderr, flush=True)
        self._wake_ranks(record)
        return True

    def _wake_ranks(self, record: AttachRecord) -> None:
        for fd in self.wake_fds:
            with contextlib.suppress(OSError):  # a full pipe is a wake-up already pending
                os.write(fd, b"w")

    def seconds_left(self) -> float | None:
        """Until the pool ends itself; None while a kernel holds it, a rank runs or no limit is set."""
        if self.holder_pid is not None or self.plan.keep_for_s is None or self.detached_since is None:
            return None
        idle_since = pool_is_idle_since(self.directory)
        if idle_since is None:
            return None
        return max(self.detached_since, idle_since) + self.plan.keep_for_s - time.time()

    def timeout_ms(self) -> int | None:
        """How long the agent may sleep before the clock needs a look."""
        if self.holder_pid is not None or self.plan.keep_for_s is None:
            return None
        left = self.seconds_left()
        seconds = _BUSY_RECHECK_S if left is None else min(max(left, 0.0), 3600.0)
        return int(seconds * 1000) + 1

    def remove_directory(self) -> None:
        """At the agent's exit: the pool's directory goes, unless a new pool took its name
        (across hosts, this host's directory only: the driver removes the pool's)."""
        if self.directory != self.plan.kept_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        try:
            with open(os.path.join(self.plan.kept_dir, META_FILE)) as meta:
                if json.load(meta).get("pool_id") != self.plan.pool_id:
                    return
        except (OSError, ValueError):
            pass
        shutil.rmtree(self.plan.kept_dir, ignore_errors=True)


def _followed_record(directory: str, signer: Signer, who: str) -> AttachRecord | None:
    """The attach record a wake-up asks to follow; one written by a kernel of another wire
    version is ignored, with a line in the log (such a kernel refuses to attach, so none should be)."""
    opened = read_attach_envelope(directory, signer)
    if opened is not None and opened.message is None:
        print(f"{who}: ignored an attach record of {opened.version.describe(ours())}; this pool speaks "
              f"{ours().describe(opened.version)}", file=sys.stderr, flush=True)
    return opened.message if opened is not None and isinstance(opened.message, AttachRecord) else None


def _drain(fd: int) -> bool:
    """Read what is in the pipe; False at its end (every writer is gone)."""
    os.set_blocking(fd, False)
    try:
        while True:
            data = os.read(fd, 512)
            if not data:
                return False
    except BlockingIOError:
        return True
