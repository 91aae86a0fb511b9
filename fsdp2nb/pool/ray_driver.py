"""The Ray driver of a multi-host pool: a helper process of the kernel, never the kernel itself.

Ray's threads and signal handlers inside a notebook kernel are a known source of crashes at
kernel restart, so this process joins the cluster instead. It reserves one bundle per host
(STRICT_SPREAD), puts one small actor on each, and each actor starts the fsdp2nb host agent as a
child in a session of its own. The kernel speaks to it in JSON lines on stdin and stdout:

    kernel -> {"address", "num_nodes", "bundle", "threads_per_rank", "log_dir"}
    driver -> {"node_ip", "token_auth"}          (or {"error"})
    kernel -> {"launch": <the agent's launch request>}
    driver -> {"started": [{"node", "host", "pid"}, ...]}   (or {"error"})
    driver -> {"exited": NODE, "host", "how"}    whenever an agent ends
    kernel -> {"stop": GRACE_S}, or closes stdin (the kernel is gone): the agents' process groups
              end first, then the actors (Ray kills only an actor's direct children, and only
              when it exits cleanly), then the placement group.

A kept pool (its plan names a kept directory) is the exception: the driver, in a session of its
own, outlives the kernel that started it, and the pool lives as long as it does (the actors and
placement group are the driver's job's, so Ray frees them when it ends, however it ends). It
stands in for the holding kernel on every host (pool/kept/on_ray.py): it watches the holder's pid, and
on SIGUSR1 (a kernel attached) or the holder's end it copies the attach record into each host's
directory through the actors, which wake their agents. It ends the pool on `{"stop"}`, SIGTERM,
or when any agent ends (`--keep-for` ran out while no kernel held the pool).

Run as `python -m fsdp2nb.pool.ray_driver`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from fsdp2nb.errors import LaunchError
from fsdp2nb.pool.kept.directory import ACTIVITY_FILE, RECORD_FILE
from fsdp2nb.pool.launcher import DEFAULT_GRACE_S, describe_exit_code, end_process_group, write_and_close

RAY_NAMESPACE = "fsdp2nb"
"""Where a pool's placement group and actors are named (`ray_names`), so `ray list actors` and
`ray.get_actor(name, namespace="fsdp2nb")` can tell whose they are."""
PLACEMENT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_lock = threading.Lock()


def report(message: dict) -> None:
    with _lock:
        try:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass  # the kernel is gone: nobody reads these any more


def ray_names(pool_id: str) -> str:
    """The name of a pool's placement group, and the start of its actors' (`-node0`, ...)."""
    return f"fsdp2nb-{pool_id}"


class AgentHost:
    """One per host (a Ray actor): starts that host's agent and ends it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.kept_dir = ""
        """A kept pool's directory on this host (pool/kept/directory.py: host_kept_dir); empty otherwise."""

    def start(self, request: str, node: int, threads_per_rank: int, log_dir: str, record: bytes = b"") -> dict:
        import ray

        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        if record:  # a kept pool: its agent and ranks read this host's copy of the attach record
            from fsdp2nb.pool.kept.on_ray import prepare_host_dir

            self.kept_dir = prepare_host_dir(request, node, record)
        env = dict(os.environ, FSDP2NB_NODE=str(node), OMP_NUM_THREADS=str(threads_per_rank),
                   PYTHONUNBUFFERED="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
        with open(os.path.join(log_dir, f"agent-node{node}.log"), "ab") as log:
            process = self.process = subprocess.Popen(
                [sys.executable, "-m", "fsdp2nb.worker.agent"], stdin=subprocess.PIPE, stdout=log, stderr=log,
                start_new_session=True, env=env,
            )
        write_and_close(process, request.encode())
        return {"node": node, "host": ray.util.get_node_ip_address(), "pid": process.pid}

    def wait(self) -> str:
        """Returns once the agent has ended: how it ended."""
        assert self.process is not None, "start() came first"
        how = describe_exit_code(self.process.wait())
        return f"was {how}" if how.startswith("killed") else how

    def stop(self, grace_s: float) -> None:
        """SIGTERM the agent (it ends its ranks), then its whole process group by force."""
        if self.process is not None:
            end_process_group(self.process, grace_s)

    def follow(self, record: bytes) -> None:
        """A kept pool's new attach record: into this host's directory, then wake the agent."""
        from fsdp2nb.pool.kept.on_ray import write_private

        write_private(os.path.join(self.kept_dir, RECORD_FILE), record)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)

    def activity(self) -> bytes:
        """This host's activity board of a kept pool (what its ranks run)."""
        try:
            with open(os.path.join(self.kept_dir, ACTIVITY_FILE), "rb") as board:
                return board.read()
        except OSError:
            return b""


def token_auth_enabled() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled

        return bool(is_token_auth_enabled())
    except Exception:  # another Ray version: go by the documented switch
        return os.environ.get("RAY_AUTH_MODE", "").lower() == "token"


class Driver:
    def __init__(self, setup: dict) -> None:
        import ray

        self.ray = ray
        self.setup = setup
        self.actors: list = []
        self.placement: Any = None
        """The pool's Ray placement group, once launched."""
        self.on_agent_exit: Callable[[], None] | None = None
        """Called (on the thread that watches the agents) when an agent has ended."""

    def connect(self) -> None:
        address = self.setup["address"]
        self.ray.init(address=None if address == "auto" else address, include_dashboard=False, namespace=RAY_NAMESPACE,
                      log_to_driver=False, logging_level="ERROR", configure_logging=False)
        report({"node_ip": self.ray.util.get_node_ip_address(), "token_auth": token_auth_enabled()})

    def launch(self, request: str, record: bytes = b"") -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        num_nodes, bundle = self.setup["num_nodes"], self.setup["bundle"]
        name = ray_names(json.loads(request)["plan"]["pool_id"])
        self.placement = placement_group([dict(bundle)] * num_nodes, strategy="STRICT_SPREAD", name=name)
        ready, _ = self.ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise LaunchError(f"the Ray cluster did not offer {num_nodes} different hosts with {bundle} free "
                              f"within {PLACEMENT_TIMEOUT_S:.0f} s (`ray status` shows what it has)")
        from fsdp2nb.pool import ray_driver  # by its module name, not __main__: the actors import it

        actor_class = self.ray.remote(max_concurrency=4)(ray_driver.AgentHost)
        options = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0))
        self.actors = [
            actor_class.options(**options, name=f"{name}-node{node}", scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement, placement_group_bundle_index=node)).remote()
            for node in range(num_nodes)
        ]
        started = self.ray.get([actor.start.remote(request, node, self.setup["threads_per_rank"],
                                                   self.setup["log_dir"], record)
                                for node, actor in enumerate(self.actors)])
        hosts = {entry["node"]: entry["host"] for entry in started}
        threading.Thread(target=self._report_exits, args=(hosts,), daemon=True).start()
        report({"started": started})

    def _report_exits(self, hosts: dict[int, str]) -> None:
        waiting = {actor.wait.remote(): node for node, actor in enumerate(self.actors)}
        while waiting:
            done, _ = self.ray.wait(list(waiting), num_returns=1)
            node = waiting.pop(done[0])
            try:
                how = self.ray.get(done[0])
            except Exception as error:  # the actor itself died (its host went away)
                how = f"was lost with its Ray actor ({type(error).__name__})"
            report({"exited": node, "host": hosts[node], "how": how})
            if self.on_agent_exit is not None:
                self.on_agent_exit()

    def stop(self, grace_s: float) -> None:
        if self.actors:
            stops = [actor.stop.remote(grace_s) for actor in self.actors]
            self.ray.wait(stops, num_returns=len(stops), timeout=grace_s + STOP_TIMEOUT_S)
            for actor in self.actors:
                self.ray.kill(actor)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
        self.ray.shutdown()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's stop button is not for this process
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a kept pool's wake-up (pool/kept/on_ray.py) must never end it
    setup = json.loads(sys.stdin.readline())
    driver = None
    keeper = None
    grace_s = DEFAULT_GRACE_S
    try:
        driver = Driver(setup)
        driver.connect()
        line = sys.stdin.readline()
        if line:
            request = json.loads(line)["launch"]
            keeper = kept_watch(driver, request)
            driver.launch(request, keeper.record_bytes() if keeper else b"")
            # A kept pool waits for its own end; any other, for a stop request or the kernel's end.
            grace_s = keeper.run() if keeper else stop_grace(sys.stdin.readline())
    except Exception as error:
        report({"error": f"{type(error).__name__}: {error}"})
        grace_s = DEFAULT_GRACE_S
    if driver is not None:
        driver.stop(grace_s)
    if keeper is not None:
        keeper.remove_directory()
    report({"stopped": True})


def stop_grace(line: str) -> float:
    """The agents' grace for their ranks: a stop request's, or the default once the kernel is gone ("")."""
    return float(json.loads(line)["stop"]) if line.strip() else DEFAULT_GRACE_S


def kept_watch(driver: Driver, request: str):  # on_ray.KeptWatch, imported only here
    """The watch of a kept pool (pool/kept/on_ray.py), or None for a pool that ends with its kernel."""
    from fsdp2nb.pool.kept.on_ray import KeptWatch
    from fsdp2nb.wire.launch_plan import LaunchPlan

    plan, key = LaunchPlan.decode(request.encode())
    return KeptWatch(driver, plan, key) if plan.kept_dir else None


if __name__ == "__main__":
    main()
