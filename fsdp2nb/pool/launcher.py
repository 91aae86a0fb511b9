"""How ranks come into being, behind one small interface.

`LocalLauncher` starts a host agent on this machine that forks the ranks. Ranks on other hosts
come from an engine that runs `python -m fsdp2nb.worker.agent` once per host with the same launch
plan: `ray_launcher` (through a Ray driver of its own) and `slurm_launcher` (one srun step).

A restart should not pay for importing torch again (most of a cold start): once a
pool is up, `LocalLauncher.start_standby()` starts the next agent ahead of time. It imports
torch and IPython, then blocks reading its launch plan from stdin; the next launch writes the
plan there instead of starting a process. A standby that is never used ends when the launcher
is closed, or on its own when the kernel goes away (it sleeps on stdin and a pidfd of the kernel).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Protocol

from fsdp2nb.host.pid_watch import PidWatch
from fsdp2nb.host.process_identity import own_process_key, process_key
from fsdp2nb.pool import reaper
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan

logger = logging.getLogger(__name__)

AGENT_COMMAND = (sys.executable, "-m", "fsdp2nb.worker.agent")


@dataclass(frozen=True)
class AgentExit:
    """How a launch's host agent ended, and which one as far as the launcher can tell.

    The pool words it once for every launcher. Where the launcher cannot tell the host (one srun
    step carries every host's agent), the pool names the host whose connection ended."""

    how: str
    """"killed by SIGKILL", "exited with code 3", "ended with the Ray driver (...)"."""
    node: int | None = None
    host: str | None = None
    pid: int | None = None
    """The agent's process, where it runs on this host."""
    every_host: bool = False
    """Every host's agent ended at once (their common parent did)."""


class LaunchedRanks(Protocol):
    """A handle on started ranks that the pool can stop."""

    def is_running(self) -> bool: ...

    def process_ids(self) -> list[int]:
        """Processes on this host that the launch started (for the orphan registry)."""

    def agent_exit(self) -> AgentExit | None:
        """How a host agent of the launch ended; None while they all run."""

    def terminate(self, grace_s: float) -> None:
        """End every rank: SIGTERM first, by force after `grace_s`. Safe to call twice."""


class Launcher(Protocol):
    num_nodes: int

    notes: list[str]
    """Lines for the cell that starts the pool (e.g. a warning about the cluster's security)."""

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        """Where the kernel listens for the ranks: a Unix socket path, or `tcp://HOST:0` on the
        address the ranks' hosts reach this one by."""

    def launch(self, plan: LaunchPlan, key: bytes) -> LaunchedRanks: ...


class AgentProcess:
    """A child process of the kernel that carries host agents: `LocalLauncher`'s agent, or the
    srun step that carries every host's (`slurm_launcher.SrunStep`). Ending it ends its ranks."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def is_running(self) -> bool:
        return self.process.poll() is None

    def process_ids(self) -> list[int]:
        return [self.process.pid]

    def agent_exit(self) -> AgentExit | None:
        code = self.process.poll()
        return None if code is None else AgentExit(describe_exit_code(code), pid=self.process.pid)

    def terminate(self, grace_s: float) -> None:
        # The agent SIGTERMs, then SIGKILLs, its ranks; each rank (in a session of its own) also
        # dies with the agent through PR_SET_PDEATHSIG.
        end_process_group(self.process, grace_s)


DEFAULT_GRACE_S = 3.0
"""The agents' grace for their ranks when no stop request said otherwise (a Ray pool's driver)."""


def describe_exit(report: RankExited) -> str:
    """How a rank ended, from its agent's report: "killed by SIGKILL", "exit code 3"."""
    if report.signal_name == "SIGKILL":
        return "killed by SIGKILL (the kernel's out-of-memory killer is its usual sender)"
    if report.signal_name:
        return f"killed by {report.signal_name}"
    return f"exit code {report.exit_code}"


def describe_agent_exit(ended: AgentExit, lost_agents: dict[int, str], devices_per_node: int) -> str:
    """Which agent ended, where and how: one wording for every launcher. `lost_agents`: node ->
    host of agents whose connection to the kernel ended (named where the launcher cannot tell)."""
    if ended.every_host:
        return f"every host's agent {ended.how}"
    if ended.pid is not None:
        return f"the host agent (pid {ended.pid}) {ended.how}"
    node, host = ended.node, ended.host
    if node is None and lost_agents:  # the launcher cannot tell; the connection that ended can
        node, host = next(iter(lost_agents.items()))
    if node is None:
        return f"the host agent {ended.how}"
    ranks = ", ".join(str(rank) for rank in range(node * devices_per_node, (node + 1) * devices_per_node))
    return f"the host agent on host {host} (node {node}, ranks {ranks}) {ended.how}"


def launch_plan(spec: PoolSpec, *, pool_id: str, address: str, runtime_dir: str, log_dir: str,
                tls_fingerprint: str = "", kept_dir: str = "", keep_for_s: float | None = None,
                memory_dir: str = "") -> LaunchPlan:
    """What every host agent of a pool is given: each node runs `spec.devices`, one rank each."""
    per_node = spec.devices
    ranks = tuple(RankPlan(rank=node * len(per_node) + local, local_rank=local, device=device, node=node)
                  for node in range(spec.num_nodes) for local, device in enumerate(per_node))
    return LaunchPlan(
        pool_id=pool_id, world_size=spec.world_size, backend=spec.backend, ranks=ranks,
        address=address, runtime_dir=runtime_dir, log_dir=log_dir,
        collective_timeout_s=spec.collective_timeout_s, kernel_pid=os.getpid(),
        master_port=_unused_loopback_port(), num_nodes=spec.num_nodes, tls_fingerprint=tls_fingerprint,
        kept_dir=kept_dir, keep_for_s=keep_for_s, memory_dir=memory_dir,
    )


def _unused_loopback_port() -> int:
    """A loopback port for MASTER_PORT, for code that builds its own store; the pool itself uses none."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_and_close(process: subprocess.Popen, data: bytes) -> None:
    """Write `data` to the stdin of `process` (started with stdin=PIPE), then close it."""
    assert process.stdin is not None, "started with stdin=PIPE"
    process.stdin.write(data)
    process.stdin.close()


def describe_exit_code(code: int) -> str:
    """How a process ended, from its Popen return code: "killed by SIGKILL", "exited with code 3"."""
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == 128 + signal.SIGTERM:
        return "ended by a SIGTERM it was sent (it ends its ranks then)"
    return f"exited with code {code}"


def end_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `process` (the leader of a session of its own), give it `grace_s` to end what it
    started, then SIGKILL its whole process group. Safe to call twice."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        _wait_for_exit(process, grace_s)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


class StandbyAgent:
    """An agent started ahead of a launch: it imports torch and IPython, then waits for its plan.

    It was started with `environment` in `cwd`; a launch uses it only while the kernel's are
    the same (a variable read at import, or the rank's `sys.path[0]`, would otherwise differ
    from what a fresh agent gets). Its output goes to a private directory until a plan names
    the pool's log directory; the reaper knows it by `standby_id`, owned by this kernel."""

    def __init__(self, command: tuple[str, ...], environment: dict[str, str]) -> None:
        self.standby_id = f"standby-{os.getpid()}-{os.urandom(4).hex()}"
        self.environment = environment
        self.cwd = os.getcwd()
        self.installed = installed_packages()
        self.log_dir = reaper.state_dir() / "standby" / self.standby_id
        self.log_dir.mkdir(mode=0o700, parents=True)
        try:
            with open(self.log_dir / "agent.log", "ab") as log:
                self.process = subprocess.Popen(
                    [*command, "--standby-log", str(self.log_dir / "agent.log"), "--kernel-pid", str(os.getpid())],
                    stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True, env=environment,
                )
        except OSError:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            raise
        reaper.record_pool(self.standby_id, own_process_key(),
                           [key for key in [process_key(self.process.pid)] if key],
                           runtime_dir=str(self.log_dir))

    def usable(self, environment: dict[str, str]) -> bool:
        return (self.process.poll() is None and environment == self.environment and os.getcwd() == self.cwd
                and installed_packages() == self.installed)

    def hand_over(self, request: bytes) -> AgentProcess:
        """Give the standby its plan; from here on it is the pool's agent, and no longer a standby.

        The agent moves what it wrote so far into the pool's log and removes `log_dir` itself."""
        assert self.process.stdin is not None
        self.process.stdin.write(request)
        self.process.stdin.close()  # a plan is one write: what the agent reads ends here
        reaper.forget_pool(self.standby_id)
        return AgentProcess(self.process)

    def close(self) -> None:
        """End the unused standby at once: it holds nothing but imported modules."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            with contextlib.suppress(OSError):  # a failed hand-over may leave unflushed bytes
                self.process.stdin.close()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        shutil.rmtree(self.log_dir, ignore_errors=True)
        reaper.forget_pool(self.standby_id)


IMPORTED_AHEAD = ("torch", "IPython", "fsdp2nb")
"""The packages a standby agent imports before its plan comes (worker/agent.py `_preload`)."""


def installed_packages() -> tuple[tuple[str, str | None, int | None], ...]:
    """Where each package a standby imports ahead is installed, and when its `__init__` there last
    changed: a standby started before an upgrade (`%pip install -U torch`) would run the old one.
    Found without importing them (the kernel never imports torch)."""
    marks = []
    for name in IMPORTED_AHEAD:
        try:
            spec = importlib.util.find_spec(name)
            origin = spec.origin if spec is not None else None
            changed = os.stat(origin).st_mtime_ns if origin else None
        except (ImportError, ValueError, OSError):
            origin, changed = None, None
        marks.append((name, origin, changed))
    return tuple(marks)


class LocalLauncher:
    """Starts one agent for this host in its own session, so the kernel's SIGINT never reaches it.

    With `start_standby()` called after a launch, the next launch hands its plan to an agent
    that has imported torch already. `close()` ends an unused standby; safe to call twice."""

    def __init__(self, command: tuple[str, ...] = AGENT_COMMAND) -> None:
        self._command = command
        self._standby: StandbyAgent | None = None

    num_nodes = 1
    notes: list[str] = []

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        return os.path.join(runtime_dir, "pool.sock")

    def launch(self, plan: LaunchPlan, key: bytes) -> AgentProcess:
        request = plan.encode(key)
        standby, self._standby = self._standby, None
        if standby is not None:
            if standby.usable(_rank_environment()):
                try:
                    return standby.hand_over(request)
                except OSError as error:  # it ended since (BrokenPipeError): start one afresh
                    logger.info("the standby agent could not take the plan (%s); starting a fresh agent", error)
            else:
                logger.info("the environment, directory or installed packages changed since the standby agent started; "
                            "starting a fresh agent")
            standby.close()
        return self._launch_cold(plan, request)

    def _launch_cold(self, plan: LaunchPlan, request: bytes) -> AgentProcess:
        agent_log = open(os.path.join(plan.log_dir, "agent.log"), "ab")
        with agent_log:
            process = subprocess.Popen(
                self._command, stdin=subprocess.PIPE, stdout=agent_log,
                stderr=agent_log, start_new_session=True, env=_rank_environment(),
            )
        assert process.stdin is not None
        process.stdin.write(request)
        process.stdin.close()
        return AgentProcess(process)

    def start_standby(self) -> None:
        """Start the next launch's agent now, if none waits; call once the pool is up, so that
        its import does not compete with the ranks' start."""
        if self._standby is None or self._standby.process.poll() is not None:
            self.close()
            try:
                self._standby = StandbyAgent(self._command, _rank_environment())
            except OSError as error:  # the pool runs; only its next restart will be a cold start
                logger.warning("fsdp2nb: could not start a standby agent for fast restarts: %s", error)

    def standby_pid(self) -> int | None:
        """The waiting standby's pid (None if there is none): for tests and benchmarks."""
        return self._standby.process.pid if self._standby is not None else None

    def close(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.close()


def _wait_for_exit(process: subprocess.Popen, timeout_s: float) -> None:
    """Wait up to `timeout_s` for `process` to end, waking as it does: Popen.wait with a timeout
    polls, up to 50 ms late, and a restart waits for the old agent."""
    poller = select.poll()
    ended = PidWatch(poller)
    watched = ended.watch(process.pid)  # False before Linux 5.3 (or gone already)
    if watched:
        try:
            poller.poll(int(timeout_s * 1000))
        finally:
            ended.close()
    try:
        process.wait(0 if watched else timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _rank_environment() -> dict[str, str]:
    env = dict(os.environ)
    # The kernel's inline backend hook is not importable as a plain backend outside a kernel.
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env.pop("JPY_PARENT_PID", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env
