"""The rank processes one host agent forked: forking each, reaping those that ended into the exit
reports the kernel reads (code or signal, last stderr lines, whether the OOM killer sent it), and
ending them all.

Kept apart from the agent (agent.py), which decides when ranks end and whom to tell: this
module knows processes and pipes, not the kernel.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable, Iterator

from fsdp2nb.host.rank_logs import rank_log_path, read_tail
from fsdp2nb.host_memory import kernel_log_names_oom_kill, oom_kill_count
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan
from fsdp2nb.worker.capture import drain_pipe

_STOP_POLL_S = 0.005
"""How often ranks being ended are looked for: a restart waits for them, and a rank ends within a
few ms of its SIGTERM. Only while stopping, for at most the grace period."""
_TERMINATE_GRACE_S = 3.0
_STDERR_TAIL_LINES = 40
_PR_SET_PDEATHSIG = 1


def oom_killer_sent(kills_before: int | None, kills_after: int | None, in_kernel_log: bool | None) -> bool | None:
    """Whether the kernel's OOM killer sent a SIGKILL: its memory cgroup counted a kill since the
    last look, or the kernel log names the process; None where neither can be read."""
    rose = None if kills_before is None or kills_after is None else kills_after > kills_before
    if rose or in_kernel_log:
        return True
    return None if rose is None and in_kernel_log is None else False


class ForkedRanks:
    """The ranks of one host, by pid, with the read ends of their output pipes."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.by_pid: dict[int, RankPlan] = {}
        self.pipes_by_pid: dict[int, list[int]] = {}
        self.oom_kills = oom_kill_count()
        """The memory cgroup's OOM-kill count when last read (None: unreadable), to tell whether
        the kernel's OOM killer sent a rank's SIGKILL."""

    def fork(self, rank_plans: Iterable[RankPlan], key: bytes) -> list[int]:
        """Fork a process for each rank; returns the write ends of their wake pipes (kept pools)."""
        wake_fds: list[int] = []
        for rank_plan in rank_plans:
            held = [fd for fds in self.pipes_by_pid.values() for fd in fds] + wake_fds
            pid, self.pipes_by_pid[pid], wake_fd = _fork_rank(self.plan, rank_plan, key, held)
            self.by_pid[pid] = rank_plan
            if wake_fd is not None:
                wake_fds.append(wake_fd)
        return wake_fds

    def reap(self) -> Iterator[tuple[int, int, RankPlan | None]]:
        """Each rank that has ended, as (pid, wait status, its plan), without waiting for any;
        what it wrote but never forwarded is appended to its log first."""
        while self.by_pid:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            rank_plan = self.by_pid.pop(pid, None)
            self._save_last_output(pid, rank_plan)
            yield pid, status, rank_plan

    def exit_report(self, rank: int, pid: int, status: int) -> RankExited:
        signal_name = None
        exit_code = None
        if os.WIFSIGNALED(status):
            signal_name = signal.Signals(os.WTERMSIG(status)).name
        else:
            exit_code = os.waitstatus_to_exitcode(status)
        oom_killer = None
        if signal_name == "SIGKILL":
            before, self.oom_kills = self.oom_kills, oom_kill_count()
            oom_killer = oom_killer_sent(before, self.oom_kills, kernel_log_names_oom_kill(pid))
        log_tail = read_tail(rank_log_path(self.plan.log_dir, rank), 8192)[-_STDERR_TAIL_LINES:]
        return RankExited(rank=rank, pid=pid, exit_code=exit_code, signal_name=signal_name,
                          stderr_tail=tuple(log_tail), oom_killer=oom_killer)

    def end_all(self) -> None:
        """SIGTERM every rank, then SIGKILL those still there after a grace period."""
        _signal_all(self.by_pid, signal.SIGTERM)
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        while self.by_pid and time.monotonic() < deadline:
            for _ in self.reap():
                pass  # ended as asked: nobody is told
            time.sleep(_STOP_POLL_S)
        _signal_all(self.by_pid, signal.SIGKILL)

    def _save_last_output(self, pid: int, rank_plan: RankPlan | None) -> None:
        """Append what the dead rank wrote but never forwarded to its log, then close the pipes."""
        for read_end in self.pipes_by_pid.pop(pid, []):
            leftover = drain_pipe(read_end)
            os.close(read_end)
            if leftover and rank_plan is not None:
                with open(rank_log_path(self.plan.log_dir, rank_plan.rank), "ab") as log:
                    log.write(leftover)


def _fork_rank(plan: LaunchPlan, rank_plan: RankPlan, key: bytes,
               agent_fds: list[int]) -> tuple[int, list[int], int | None]:
    """Fork one rank; returns its pid, the read ends of its stdout/stderr pipes and (kept pools)
    the write end of its wake pipe.

    The agent keeps a copy of each read end so that, should the rank die, the agent can still
    read what it wrote last (the rank's own forwarding thread dies with it). `agent_fds` are the
    agent's copies for earlier ranks, which the new rank must not hold.
    """
    pipes = {1: os.pipe(), 2: os.pipe()}
    wake = os.pipe() if plan.kept_dir else None
    pid = os.fork()
    if pid:
        for _, write_end in pipes.values():
            os.close(write_end)
        if wake is not None:
            os.close(wake[0])
        return pid, [read_end for read_end, _ in pipes.values()], wake[1] if wake is not None else None
    exit_code = 1
    try:
        for fd in agent_fds:
            os.close(fd)
        if wake is not None:
            os.close(wake[1])
        _die_with_parent()
        # A session of its own, as torchrun gives each rank: with autogroup scheduling (the Linux
        # default) a session is a scheduling group, and ranks sharing the agent's would share
        # one group's CPU share against every other process on a busy host.
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from fsdp2nb.worker.rank import run_rank

        run_rank(plan, rank_plan, key, pipes, wake_fd=wake[0] if wake is not None else None)
        exit_code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # Never through Python's shutdown: gloo's worker threads may still be releasing a finished
        # collective's tensors, and a thread that takes the GIL while the interpreter finalizes
        # is ended inside a C++ destructor, which aborts the process (SIGABRT).
        os._exit(exit_code)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that forked it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the agent's own watch still ends the ranks


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in list(pids):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
