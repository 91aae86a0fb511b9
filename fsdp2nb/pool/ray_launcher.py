"""Ranks on the hosts of a Ray cluster: the kernel's side of `ray_driver`.

The kernel never imports Ray. It starts the driver as a child process (its own session, so the
stop button does not reach it; its stdin closes when the kernel dies, which ends it and, through
it, the actors and agents, unless the pool is kept: see pool/kept/on_ray.py), reads the driver's address
on the cluster network, listens there with TLS, and hands the driver the launch request: the
plan and the pool key travel on the driver's stdin and in actor arguments, never on a command line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading

from fsdp2nb.errors import LaunchError
from fsdp2nb.pool.launcher import AgentExit, describe_exit_code, end_process_group
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.endpoints import tcp_address
from fsdp2nb.wire.launch_plan import LaunchPlan

DRIVER_READY_TIMEOUT_S = 120.0
"""Joining the cluster, then reserving its hosts and starting one agent on each."""
TOKEN_AUTH_OFF = ("fsdp2nb: Ray's token authentication is off (RAY_AUTH_MODE=token turns it on): anyone who "
                  "reaches this Ray cluster can run code on it")


class RayLaunchError(LaunchError):
    """The Ray driver could not join the cluster or place the pool; one line says why."""


class RayAgents:
    """The started agents, as the pool sees them: through the driver's reports."""

    def __init__(self, driver: _Driver, started: list[dict]) -> None:
        self._driver = driver
        self.hosts = {entry["node"]: entry["host"] for entry in started}

    def is_running(self) -> bool:
        return self._driver.running() and not self._driver.exits

    def process_ids(self) -> list[int]:
        return [self._driver.process.pid]

    def agent_exit(self) -> AgentExit | None:
        if self._driver.exits:
            node, report = next(iter(self._driver.exits.items()))
            return AgentExit(report["how"], node=node, host=report["host"])
        if not self._driver.running():
            how = describe_exit_code(self._driver.process.returncode)
            return AgentExit(f"ended with the Ray driver ({how})", every_host=True)
        return None

    def terminate(self, grace_s: float) -> None:
        self._driver.stop(grace_s)


class RayLauncher:
    """Places one host agent on each of `num_nodes` Ray hosts."""

    def __init__(self, spec: PoolSpec) -> None:
        assert spec.placement is not None and spec.placement.engine == "ray"
        self.spec = spec
        self._placement = spec.placement
        self.num_nodes = spec.placement.num_nodes
        self.notes: list[str] = []
        """Lines for the cell that starts the pool (a warning about the cluster's security)."""
        self._driver: _Driver | None = None

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        if importlib.util.find_spec("ray") is None:
            raise RayLaunchError("--ray needs Ray installed beside the kernel and on every host: "
                                 "`pip install ray cryptography` (from a clone of fsdp2nb: `pip install -e '.[ray]'`)")
        ranks_per_node = len(self.spec.devices)
        bundle = {"GPU": ranks_per_node, "CPU": 1} if self.spec.uses_gpus else {"CPU": ranks_per_node}
        self._driver = _Driver(log_dir)
        reply = self._driver.ask({
            "address": self._placement.address or "auto", "num_nodes": self.num_nodes, "bundle": bundle,
            "threads_per_rank": 1, "log_dir": log_dir,
        })
        if not reply["token_auth"]:
            self.notes.append(TOKEN_AUTH_OFF)
        return tcp_address(self._placement.listen or reply["node_ip"], 0)

    def launch(self, plan: LaunchPlan, key: bytes) -> RayAgents:
        assert self._driver is not None, "listen_address() starts the driver first"
        request = plan.encode(key).decode()  # JSON: travels inside the driver's JSON lines
        reply = self._driver.ask({"launch": request})
        return RayAgents(self._driver, reply["started"])


class _Driver:
    """The driver process and the JSON lines it sends, read by a thread of its own."""

    def __init__(self, log_dir: str) -> None:
        with open(os.path.join(log_dir, "ray-driver.log"), "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fsdp2nb.pool.ray_driver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, start_new_session=True,
            )
        assert self.process.stdin is not None and self.process.stdout is not None, "started with pipes"
        self._stdin, self._stdout = self.process.stdin, self.process.stdout
        self.exits: dict[int, dict] = {}
        self._replies: queue.SimpleQueue[dict] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True, name="fsdp2nb-ray-driver").start()

    def _read(self) -> None:
        for line in self._stdout:
            message = json.loads(line)
            if "exited" in message:
                self.exits[message["exited"]] = message
            else:
                self._replies.put(message)
        self._replies.put({"error": f"the Ray driver ended ({describe_exit_code(self.process.wait())}); see ray-driver.log"})

    def ask(self, message: dict) -> dict:
        self._send(message)
        try:
            reply = self._replies.get(timeout=DRIVER_READY_TIMEOUT_S)
        except queue.Empty:
            raise RayLaunchError(f"the Ray driver did not answer within {DRIVER_READY_TIMEOUT_S:.0f} s") from None
        if "error" in reply:
            raise RayLaunchError(f"Ray: {reply['error']}")
        return reply

    def _send(self, message: dict) -> None:
        try:
            self._stdin.write((json.dumps(message) + "\n").encode())
            self._stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it ended: its last words arrive as a reply

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float) -> None:
        """Ask the driver to end the agents (their ranks first), then make sure it has ended."""
        if self.running():
            self._send({"stop": grace_s})
            try:
                self.process.wait(grace_s + 30)
            except subprocess.TimeoutExpired:
                pass
        end_process_group(self.process, 0)
