"""How ranks come into being, behind one small interface.

`LocalLauncher` starts a host agent on this machine that forks the ranks. Ranks on other hosts
come from an engine that runs `python -m fsdp2nb.worker.agent` once per host with the same launch
plan: `ray_launcher` (through a Ray driver of its own) and `slurm_launcher` (one srun step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from typing import Protocol

from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.protocol import LaunchPlan


class LaunchError(RuntimeError):
    """The engine could not start the ranks (no Ray cluster, no srun, too few hosts); one line says why."""


class LaunchedRanks(Protocol):
    """A handle on started ranks that the pool can stop."""

    def is_running(self) -> bool: ...

    def process_ids(self) -> list[int]:
        """Processes on this host that the launch started (for the orphan registry)."""

    def exit_description(self) -> str | None:
        """How the launch's own process (the host agent) ended, e.g. "killed by SIGKILL"; None while it runs."""

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


def launcher_for(spec: PoolSpec) -> Launcher:
    """The launcher a spec asks for: this host, or the hosts Ray or Slurm provides."""
    if spec.placement is None:
        return LocalLauncher()
    if spec.placement.engine == "ray":
        from fsdp2nb.pool.ray_launcher import RayLauncher

        return RayLauncher(spec)
    from fsdp2nb.pool.slurm_launcher import SlurmLauncher

    return SlurmLauncher(spec)


class LocalAgent:
    """The host agent process started by `LocalLauncher`."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    def is_running(self) -> bool:
        return self.process.poll() is None

    def process_ids(self) -> list[int]:
        return [self.process.pid]

    def exit_description(self) -> str | None:
        code = self.process.poll()
        if code is None:
            return None
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        if code == 128 + signal.SIGTERM:
            return "ended by a SIGTERM it was sent (it ends its ranks then)"
        return f"exited with code {code}"

    def terminate(self, grace_s: float) -> None:
        if self.is_running():
            self.process.send_signal(signal.SIGTERM)  # the agent SIGTERMs, then SIGKILLs, its ranks
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The agent has its own session: one killpg ends it; its ranks (each in a session of
        # its own) die with it through PR_SET_PDEATHSIG.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()


class LocalLauncher:
    """Starts one agent for this host in its own session, so the kernel's SIGINT never reaches it."""

    num_nodes = 1
    notes: list[str] = []

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        return os.path.join(runtime_dir, "pool.sock")

    def launch(self, plan: LaunchPlan, key: bytes) -> LocalAgent:
        agent_log = open(os.path.join(plan.log_dir, "agent.log"), "ab")  # noqa: SIM115
        with agent_log:
            process = subprocess.Popen(
                [sys.executable, "-m", "fsdp2nb.worker.agent"], stdin=subprocess.PIPE, stdout=agent_log,
                stderr=agent_log, start_new_session=True, env=_rank_environment(),
            )
        assert process.stdin is not None
        process.stdin.write(json.dumps({"plan": asdict(plan), "key": key.hex()}).encode())
        process.stdin.close()
        return LocalAgent(process)


def _rank_environment() -> dict[str, str]:
    env = dict(os.environ)
    # The kernel's inline backend hook is not importable as a plain backend outside a kernel.
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env.pop("JPY_PARENT_PID", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env
