"""The host agent: one process per host that starts that host's ranks and watches over them.

It imports torch and IPython once, then forks each rank from itself (forked_ranks.py), so N
ranks cost one heavy import instead of N. The agent never touches CUDA or opens sockets before
forking, which keeps the fork safe. Afterwards it tells the kernel of each rank's exit and ends
every rank when the kernel that started it goes away, once they have written the newest
snapshot in host memory to disk (within a bound: host/persisting.py). This module is the
agent's side of the kernel: its connection, the kernel's end, a kept pool's holder.

Run as `python -m fsdp2nb.worker.agent`; the launch plan and pool key arrive as JSON on stdin,
read only once torch is imported, so that an agent can be started ahead of its launch.
On a pool that spans hosts every host's agent reads the same plan and starts the ranks of its
own node: `FSDP2NB_NODE` (set by the Ray actor that starts it) or Slurm's `SLURM_NODEID`. There
the kernel is no process it can watch: the end of its connection to the kernel (TCP keepalive
notices a vanished host) means the kernel is gone, as does the end of the process that started it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

from fsdp2nb.checkpoint.layout import read_latest
from fsdp2nb.host.memory_store import KeptSnapshot, kept_snapshots, remove_store
from fsdp2nb.host.persisting import PERSIST_TIMEOUT_ENV, mark_persisting, persist_timeout_s
from fsdp2nb.host.pid_watch import PidWatch
from fsdp2nb.pool.kept.directory import host_kept_dir
from fsdp2nb.pool.kept.keeper import AgentKeeper
from fsdp2nb.wire.channels import RankChannels
from fsdp2nb.wire.launch_plan import LaunchPlan
from fsdp2nb.wire.signing import Signer
from fsdp2nb.worker.forked_ranks import ForkedRanks

_WATCH_INTERVAL_S = 0.05
_KERNEL_CHECK_S = 1.0
"""How often to look for a vanished kernel where it cannot be waited for (no pidfd_open)."""


def node_index() -> int:
    """Which host of the plan this agent is: its ranks are those of this node."""
    return int(os.environ.get("FSDP2NB_NODE") or os.environ.get("SLURM_NODEID") or 0)


def _preload() -> None:
    """Import what every rank needs before forking, so that each rank skips it."""
    import IPython.core.interactiveshell  # noqa: F401
    import torch
    import torch.distributed
    import torch.distributed.device_mesh  # noqa: F401

    import fsdp2nb.worker.rank
    import fsdp2nb.worker.shell  # noqa: F401


class Agent:
    """Owns the ranks of one host; `run()` returns when they have all ended."""

    def __init__(self, plan: LaunchPlan, key: bytes, node: int = 0) -> None:
        self.plan = plan
        self.key = key
        self.node = node
        self.starter_pid = plan.kernel_pid if not plan.multi_host else os.getppid()
        """The process whose end ends the ranks: the kernel, or (across hosts) whatever started
        this agent, a Ray actor or Slurm's step daemon."""
        self.ranks = ForkedRanks(plan)
        self.stopping = False
        self.stop_requested = False
        self.pool_ended = False
        """Its kernel is gone (a kept pool: its time is up): nobody will restore its snapshots."""
        self.keeper: AgentKeeper | None = None
        """A kept pool's holder, wake pipes and keep-for clock (pool/kept/keeper.py)."""
        self.persisting: _Persisting | None = None
        """Set once the kernel is gone: the ranks' time to write its newest snapshot to disk."""

    def run(self) -> int:
        """Returns the agent's exit code: 143 (as for SIGTERM) when asked to stop, so the kernel
        can tell a SIGTERM it did not send (a rank's code, another process) from ranks that ended."""
        os.makedirs(self.plan.log_dir, mode=0o700, exist_ok=True)  # on another host it may not exist yet
        if self.plan.kept_dir:  # a kernel that attaches wakes the agent so (before, it would end it)
            signal.signal(signal.SIGUSR1, _ignore)
        wake_fds = self.ranks.fork(self.plan.ranks_of_node(self.node), self.key)
        # Connect only after forking, so that no rank inherits the agent's connection.
        self.channels = RankChannels(Signer(self.key), self.plan.address, rank=None,
                                     fingerprint=self.plan.tls_fingerprint, node=self.node,
                                     kept=bool(self.plan.kept_dir))
        if self.plan.kept_dir:
            directory = host_kept_dir(self.plan.kept_dir, self.node, self.plan.multi_host)
            self.keeper = AgentKeeper(self.plan, Signer(self.key), self.channels, directory)
            self.keeper.wake_fds = wake_fds
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "stop_requested", True))
        try:
            self._watch()
        finally:
            self.channels.close()
            if self.keeper is not None:
                self.keeper.remove_directory()
            if self.persisting is not None and self.persisting.bound_s > 0:
                self._note(self.persisting.outcome())
            if self.pool_ended:  # a restart's SIGTERM keeps them for the next ranks
                remove_store(self.plan.memory_dir)
        return 128 + signal.SIGTERM if self.stop_requested else 0

    def _watch(self) -> None:
        kernel_link = self.channels.events_fileno() if self.plan.multi_host and self.keeper is None else None
        wakeups = _Wakeups(self._watched_pid(), kernel_link)
        while self.ranks.by_pid:
            if self.keeper is not None:
                # A kept pool outlives its kernel, but not the Ray actor that started its agent.
                kernel_gone = self.plan.multi_host and os.getppid() != self.starter_pid
                self._follow_holder(wakeups)
            else:  # nobody can use these ranks any more:
                kernel_gone = os.getppid() != self.starter_pid or wakeups.link_closed()
                self.pool_ended = self.pool_ended or kernel_gone
            if (kernel_gone or self.stop_requested) and not self.stopping:
                if self.stop_requested or self.keeper is not None or not self._ranks_may_persist():
                    self._stop()  # the ranks of a kept pool write nothing at its end
            self._reap_exited()
            if not self.ranks.by_pid:
                break  # the last rank ended: nothing left to wait for (an endless wait here kept a
                # politely stopped pool's agent alive until the kernel's grace period ran out)
            if self.stopping or self.persisting is not None:  # the kernel's pidfd may stay readable
                time.sleep(_WATCH_INTERVAL_S)
            else:
                wakeups.wait(self.keeper.timeout_ms() if self.keeper is not None else wakeups.timeout_ms)

    def _ranks_may_persist(self) -> bool:
        """Whether the ranks of a kernel that died may go on writing its newest snapshot to disk
        (checkpoint/persist_on_exit.py): they end by themselves once done, within the bound."""
        if self.persisting is None:
            self.persisting = self._start_persisting()
        if self.persisting.time_left() > 0:
            return True
        self.persisting.gave_up = self.persisting.bound_s > 0
        return False

    def _start_persisting(self) -> _Persisting:
        """Nothing to wait for (a bound of 0) where no snapshot is whole or persisting is off."""
        bound_s, refused = persist_timeout_s()
        if refused:
            self._note(refused)
        snapshots = kept_snapshots(self.plan.memory_dir)
        if not snapshots or bound_s <= 0:
            return _Persisting(snapshots, 0.0)
        mark_persisting(self.plan.memory_dir, time.time() + bound_s)  # a new kernel's reaper waits for it
        kept = " and ".join(snapshot.describe() for snapshot in snapshots)
        self._note(f"kernel {self.starter_pid} is gone; its ranks write the newest snapshot in host memory "
                   f"({kept}) to disk where it is newer than the newest checkpoint, for at most {bound_s:g} s "
                   f"({PERSIST_TIMEOUT_ENV}), before that memory is freed")
        return _Persisting(snapshots, bound_s)

    def _note(self, message: str) -> None:
        """A line for the agent's log and the pool's (the kernel that kept pool.log is gone)."""
        print(f"fsdp2nb agent: {message}", flush=True)
        now = time.time()
        stamp = f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))},{int(now * 1000) % 1000:03d}"
        with contextlib.suppress(OSError), open(os.path.join(self.plan.log_dir, "pool.log"), "a") as log:
            log.write(f"{stamp} INFO agent: {message}\n")  # the layout of pool.log's own lines

    def _watched_pid(self) -> int | None:
        """Whose end wakes the agent: the kernel; a kept pool's holder; across hosts, a kept
        pool's Ray actor (the holder is no process of this host)."""
        if self.keeper is None or not self.keeper.watches_holder:
            return self.starter_pid
        return self.keeper.holder_pid

    def _follow_holder(self, wakeups: _Wakeups) -> None:
        """A kept pool: note a holder that ended or changed, and end the pool once its time is up."""
        keeper = self.keeper
        if keeper.watches_holder and keeper.holder_pid is not None and wakeups.pid_ended():
            print(f"fsdp2nb agent: kernel {keeper.holder_pid} is gone; the pool keeps running", flush=True)
            keeper.holder_ended()
            wakeups.watch_pid(None)
        if keeper.follow_record() and keeper.watches_holder:
            wakeups.watch_pid(keeper.holder_pid)
        left = keeper.seconds_left()
        if left is not None and left <= 0 and not self.stop_requested:
            print(f"fsdp2nb agent: no kernel held the pool and it ran nothing for {self.plan.keep_for_s:g} s "
                  "(--keep-for); ending it", flush=True)
            self.stop_requested = self.pool_ended = True

    def _reap_exited(self) -> None:
        for pid, status, rank_plan in self.ranks.reap():
            if rank_plan is not None and not self.stopping and self.persisting is None:  # else no kernel to tell
                report = self.ranks.exit_report(rank_plan.rank, pid, status)
                try:
                    told = self.channels.send_event(report)
                except OSError:  # the kernel went a moment ago (its connection broke before its pid ended)
                    told = False
                if self.keeper is not None and (not told or self.keeper.holder_pid is None):
                    # No kernel to restart it: the others keep their state, the next kernel hears of it.
                    self.keeper.rank_died(report)

    def _stop(self) -> None:
        """End every rank; from now on no exit is reported to the kernel."""
        self.stopping = True
        self.ranks.end_all()


class _Persisting:
    """The time a dead kernel's ranks get to write its newest snapshot to disk, and how it went."""

    def __init__(self, snapshots: list[KeptSnapshot], bound_s: float) -> None:
        self.snapshots, self.bound_s = snapshots, bound_s
        self.started = time.monotonic()
        self.gave_up = False

    def time_left(self) -> float:
        return self.started + self.bound_s - time.monotonic()

    def outcome(self) -> str:
        """What became of it, once the ranks have ended."""
        if self.gave_up:
            return (f"the ranks did not finish writing the snapshot in {self.bound_s:g} s ({PERSIST_TIMEOUT_ENV}); "
                    "they were ended and the host memory freed anyway")
        latest = "; ".join(f"LATEST of {snapshot.directory} names step {read_latest(Path(snapshot.directory))}"
                           for snapshot in self.snapshots)
        return (f"the ranks ended {time.monotonic() - self.started:.1f} s after their kernel ({latest}); "
                "the host memory is freed")


class _Wakeups:
    """Sleeps until there is something to watch: a rank ended (SIGCHLD), the kernel asked to stop
    (SIGTERM) or the kernel ended (its pidfd). Polling instead woke the agent 20 times a second,
    taking a core from training ranks on a host with none spare. Call from the main thread."""

    def __init__(self, kernel_pid: int | None, kernel_link: int | None = None) -> None:
        self._kernel_link = kernel_link
        self._signals, write_end = os.pipe()
        for fd in (self._signals, write_end):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _ignore)  # a Python handler, so SIGCHLD reaches the pipe
        self._poller = select.poll()
        self._poller.register(self._signals, select.POLLIN)
        self.timeout_ms: int | None = None
        self._pid = PidWatch(self._poller)
        self.watch_pid(kernel_pid)
        if kernel_link is not None:  # the kernel never sends on it: readable means closed
            self._poller.register(kernel_link, select.POLLIN | select.POLLRDHUP)

    def watch_pid(self, pid: int | None) -> None:
        """Wake when `pid` (the kernel) ends, instead of the one watched so far; None: none."""
        if not self._pid.watch(pid):  # before Linux 5.3, or the kernel is gone already
            self.timeout_ms = int(_KERNEL_CHECK_S * 1000)

    def pid_ended(self) -> bool:
        """Whether the watched process has ended."""
        return self._pid.ended()

    def link_closed(self) -> bool:
        """Whether the kernel's end of the agent's connection is closed (or the connection broke)."""
        if self._kernel_link is None:
            return False
        poller = select.poll()
        poller.register(self._kernel_link, select.POLLIN | select.POLLRDHUP)
        return bool(poller.poll(0))

    def wait(self, timeout_ms: int | None) -> None:
        self._poller.poll(timeout_ms)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._signals, 512):
                pass


def _ignore(signum, frame) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    """Import first, then read the plan: a standby agent (pool/launcher.py) waits in that read,
    torch imported, until a launch writes its plan; end of file means that none will come."""
    parser = argparse.ArgumentParser(prog="python -m fsdp2nb.worker.agent")
    parser.add_argument("--standby-log", help="where a standby writes until its plan names the pool's log")
    parser.add_argument("--kernel-pid", type=int, help="the kernel that started this agent (default: the parent)")
    args = parser.parse_args(argv)
    standby_log, kernel_pid = args.standby_log, args.kernel_pid or os.getppid()
    # A signal mask survives exec: started from a thread that blocks signals (a Ray actor's),
    # the agent would never wake for SIGCHLD, nor its ranks for the stop button's SIGINT.
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    _preload()
    request = sys.stdin.buffer.readline() if _wait_for_plan(kernel_pid) else b""
    if not request:
        _forget_standby_log(standby_log)
        _exit(0)
    plan, key = LaunchPlan.decode(request)
    if standby_log is not None:
        _log_to(os.path.join(plan.log_dir, "agent.log"), standby_log)
    try:
        code = Agent(plan, key, node_index()).run()
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def _wait_for_plan(kernel_pid: int) -> bool:
    """Sleep until stdin has data or its end, or the kernel that started this agent has ended;
    False for the kernel's end. End of file alone would miss a kernel whose forked child (a
    `fork`ed multiprocessing worker, say) still holds the pipe's other end."""
    poller = select.poll()
    kernel = PidWatch(poller)
    if not kernel.watch(kernel_pid):  # before Linux 5.3, or gone already: end of file tells
        return os.getppid() == kernel_pid
    if os.getppid() != kernel_pid:  # the kernel ended while torch was imported (and its pid was reused)
        kernel.close()
        return False
    poller.register(sys.stdin.fileno(), select.POLLIN)
    ready = {fd for fd, _ in poller.poll()}
    kernel.close()
    return sys.stdin.fileno() in ready


def _log_to(path: str, standby_log: str) -> None:
    """Point fds 1 and 2 at the pool's agent log, carrying over what the standby wrote before."""
    with open(path, "ab") as log:
        with contextlib.suppress(OSError), open(standby_log, "rb") as earlier:
            shutil.copyfileobj(earlier, log)
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
    _forget_standby_log(standby_log)


def _forget_standby_log(standby_log: str | None) -> None:
    if standby_log is not None:
        shutil.rmtree(os.path.dirname(standby_log), ignore_errors=True)


def _exit(code: int) -> None:
    """Exit without Python's shutdown, which is slow with torch imported: every stop and
    restart of a pool waits for the agent's exit. The agent holds nothing that needs it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
