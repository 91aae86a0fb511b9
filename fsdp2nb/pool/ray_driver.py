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

Run as `python -m fsdp2nb.pool.ray_driver`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from fsdp2nb.pool.launcher import describe_exit_code, end_process_group

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


class AgentHost:
    """One per host (a Ray actor): starts that host's agent and ends it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(self, request: str, node: int, threads_per_rank: int, log_dir: str) -> dict:
        import ray

        os.makedirs(log_dir, mode=0o700, exist_ok=True)
        env = dict(os.environ, FSDP2NB_NODE=str(node), OMP_NUM_THREADS=str(threads_per_rank),
                   PYTHONUNBUFFERED="1", MPLBACKEND="module://matplotlib_inline.backend_inline")
        with open(os.path.join(log_dir, f"agent-node{node}.log"), "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fsdp2nb.worker.agent"], stdin=subprocess.PIPE, stdout=log, stderr=log,
                start_new_session=True, env=env,
            )
        self.process.stdin.write(request.encode())
        self.process.stdin.close()
        return {"node": node, "host": ray.util.get_node_ip_address(), "pid": self.process.pid}

    def wait(self) -> str:
        """Returns once the agent has ended: how it ended."""
        how = describe_exit_code(self.process.wait())
        return f"was {how}" if how.startswith("killed") else how

    def stop(self, grace_s: float) -> None:
        """SIGTERM the agent (it ends its ranks), then its whole process group by force."""
        if self.process is not None:
            end_process_group(self.process, grace_s)


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
        self.placement = None

    def connect(self) -> None:
        address = self.setup["address"]
        self.ray.init(address=None if address == "auto" else address, include_dashboard=False,
                      log_to_driver=False, logging_level="ERROR", configure_logging=False)
        report({"node_ip": self.ray.util.get_node_ip_address(), "token_auth": token_auth_enabled()})

    def launch(self, request: str) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        num_nodes, bundle = self.setup["num_nodes"], self.setup["bundle"]
        self.placement = placement_group([dict(bundle)] * num_nodes, strategy="STRICT_SPREAD")
        ready, _ = self.ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"the Ray cluster did not offer {num_nodes} different hosts with {bundle} free "
                               f"within {PLACEMENT_TIMEOUT_S:.0f} s (`ray status` shows what it has)")
        from fsdp2nb.pool import ray_driver  # by its module name, not __main__: the actors import it

        actor_class = self.ray.remote(max_concurrency=4)(ray_driver.AgentHost)
        options = dict(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0))
        self.actors = [
            actor_class.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement, placement_group_bundle_index=node)).remote()
            for node in range(num_nodes)
        ]
        started = self.ray.get([actor.start.remote(request, node, self.setup["threads_per_rank"],
                                                   self.setup["log_dir"])
                                for node, actor in enumerate(self.actors)])
        report({"started": started})
        hosts = {entry["node"]: entry["host"] for entry in started}
        threading.Thread(target=self._report_exits, args=(hosts,), daemon=True).start()

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
    setup = json.loads(sys.stdin.readline())
    driver = None
    try:
        driver = Driver(setup)
        driver.connect()
        line = sys.stdin.readline()
        if line:
            driver.launch(json.loads(line)["launch"])
            line = sys.stdin.readline()  # a stop request, or "" when the kernel is gone
        grace_s = json.loads(line)["stop"] if line.strip() else 3.0
    except Exception as error:
        report({"error": f"{type(error).__name__}: {error}"})
        grace_s = 3.0
    if driver is not None:
        driver.stop(grace_s)
    report({"stopped": True})


if __name__ == "__main__":
    main()
