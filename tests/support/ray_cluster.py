"""A real Ray cluster over TestHosts: a head in host 0's namespace, a worker node in each other one.

    with TestHosts(2) as hosts, RayCluster(hosts, python=sys.executable) as cluster:
        cluster.wait_until_nodes(2)
        hosts[0].run([sys.executable, "driver.py", cluster.address], env=cluster.driver_env())

Each node is one `ray start --block` process: it stays in the foreground with the node's processes
as its children, so the cluster is stopped by the processes started here, never by `ray stop`
(which ends every Ray process of the user on the machine). Nodes bind their own namespace's address
(`--node-ip-address`), start no dashboard, share no temp dir (one short private directory per
cluster, one subdirectory per node, so Unix socket paths stay well under 107 characters), and have
a small object store. Their ports are fixed (each namespace has a port space of its own). A
raylet aborts when its Python agents have not written their port files within a fixed 15 s, which
a loaded machine can exceed; the values are known beforehand, so they are written ahead of the
agents (see _write_agent_port_files), and a node whose raylet or GCS aborts all the same is
started again (at most START_ATTEMPTS times). RAY_AUTH_MODE and every other setting of the caller's
environment pass through unchanged.

The driver (a test's script, or the product's Ray helper) must run inside host 0's namespace with
`driver_env()`: its RAY_TMPDIR is the head's temp dir, where Ray records the node's address.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import psutil

from tests.support.netns import TestHost, TestHosts, kill_namespace_processes

logger = logging.getLogger(__name__)

GCS_PORT = 6379
# Fixed per-node ports; each namespace has its own port space, so they cannot collide.
NODE_PORTS = {
    "--node-manager-port": 6380,
    "--object-manager-port": 6381,
    "--dashboard-agent-grpc-port": 6382,  # the metrics agent
    "--dashboard-agent-listen-port": 6383,
    "--metrics-export-port": 6384,
    "--runtime-env-agent-port": 6385,
    "--min-worker-port": 10000,
    "--max-worker-port": 10999,
}
OBJECT_STORE_BYTES = 80_000_000
AGENT_PORT_FILES = {
    "dashboard_agent_listen_port": -1,
    "runtime_env_agent_port": NODE_PORTS["--runtime-env-agent-port"],
}
"""The agent port files written ahead of the agents (see _write_agent_port_files)."""
START_ATTEMPTS = 3
STARTED_MARKER = "Ray runtime started"
"""The line `ray start` prints once its node has registered with the GCS."""
_FATAL_LINE = re.compile(r"^\[[^\]]* [CF] \d+ \d+\] .*$", re.MULTILINE)
"""A line at Ray's C (check failed) or F (fatal) level: the process is aborting."""

# Counts the alive nodes from inside host 0's namespace; prints them as JSON.
_COUNT_NODES = textwrap.dedent("""
    import json, sys, time
    import ray
    address, node_ip, wanted, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    ray.init(address=address, _node_ip_address=node_ip, logging_level="ERROR", log_to_driver=False)
    deadline = time.monotonic() + timeout_s
    while True:
        alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        if len(alive) >= wanted or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    print(json.dumps(alive))
    ray.shutdown()
    sys.exit(0 if len(alive) >= wanted else 3)
""")


class RayCluster:
    """A Ray head on `hosts[0]` and one worker node on each other host; stop() ends all of it.

    Construction starts the nodes one after the other and returns once each `ray start` has said
    its node is registered, retrying a node whose raylet or GCS aborted; it raises with the node's
    log tail when the last attempt fails or a node is not up within `start_timeout_s` (attempts
    included). `wait_until_nodes` then confirms from a driver's point of view.
    """

    def __init__(
        self,
        hosts: TestHosts,
        *,
        python: str,
        num_cpus: int = 2,
        start_timeout_s: float = 120.0,
        keep_temp: bool = False,
    ) -> None:
        if num_cpus < 1:
            raise ValueError(f"num_cpus={num_cpus!r}: must be at least 1")
        self.hosts = hosts
        self.python = python
        self.num_cpus = num_cpus
        self.address = f"{hosts[0].address}:{GCS_PORT}"
        """The GCS address drivers and worker nodes connect to, e.g. "10.213.0.1:6379"."""
        self.temp_dir = Path(tempfile.mkdtemp(prefix="f2r", dir="/tmp"))
        """This cluster's private temp dir; node i's Ray temp dir is temp_dir / f"h{i}"."""
        self.start_seconds: list[float] = []
        """How long each node's `ray start` took to report its node up, host 0 first."""
        self._keep_temp = keep_temp
        self._procs: list[subprocess.Popen] = []
        self._stopped = False
        try:
            for host in hosts:
                self._start_node(host, start_timeout_s)
        except BaseException:
            self.stop()
            raise

    # -- start ----------------------------------------------------------------------------------

    def node_dir(self, host: TestHost) -> Path:
        """The Ray temp dir of `host`'s node (its logs are under session_latest/logs)."""
        return self.temp_dir / f"h{host.index}"

    def log_path(self, host: TestHost) -> Path:
        """Where `host`'s `ray start` writes its output."""
        return self.temp_dir / f"h{host.index}.log"

    def _start_node(self, host: TestHost, timeout_s: float) -> None:
        """Start `host`'s node, again after a raylet or GCS abort, up to `START_ATTEMPTS` times.

        The agents' port files are written ahead (_write_agent_port_files); a raylet that aborts
        all the same (a Ray release that names those files differently, say) gets a new attempt,
        which finds the agents' imports cached.
        """
        started = time.monotonic()
        for attempt in range(1, START_ATTEMPTS + 1):
            proc = self._launch(host)
            failure = self._wait_until_up(host, proc, started + timeout_s)
            if failure is None:
                break
            if attempt == START_ATTEMPTS or failure.startswith("timeout"):
                raise RuntimeError(f"ray start on {host.name}: {failure}\n{self.log_tail(host)}")
            logger.warning("ray node on %s, attempt %d: %s; starting it again", host.name, attempt, failure)
            self._end_node(host, proc, attempt)
        self.start_seconds.append(round(time.monotonic() - started, 2))
        logger.info("ray node on %s up in %.1f s", host.name, self.start_seconds[-1])

    def _launch(self, host: TestHost) -> subprocess.Popen:
        node_dir = self.node_dir(host)
        node_dir.mkdir()
        args = [
            self.python, "-m", "ray.scripts.scripts", "start", "--block",
            "--node-ip-address", host.address,
            "--num-cpus", str(self.num_cpus),
            "--object-store-memory", str(OBJECT_STORE_BYTES),
            "--temp-dir", str(node_dir),
            "--disable-usage-stats",
        ]
        for option, port in NODE_PORTS.items():
            args += [option, str(port)]
        if host.index == 0:
            args += ["--head", "--port", str(GCS_PORT), "--include-dashboard=false"]
        else:
            args += ["--address", self.address]
        env = dict(
            os.environ,
            RAY_TMPDIR=str(node_dir),
            # Registration with the GCS waits this long (default 10 s): ample room on a loaded machine.
            RAY_raylet_start_wait_time_s="120",
            # How long a raylet waits for its runtime env agent to answer (default 30 s).
            RAY_agent_register_timeout_ms="120000",
        )
        with open(self.log_path(host), "wb") as log:
            proc = host.popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def _wait_until_up(self, host: TestHost, proc: subprocess.Popen, deadline: float) -> str | None:
        """None once `ray start` says the node is up, else what went wrong."""
        log = self.log_path(host)
        ports_written = False
        while STARTED_MARKER not in log.read_text(errors="replace"):
            if not ports_written:
                ports_written = _write_agent_port_files(proc.pid)
            if proc.poll() is not None:
                return f"exited with {proc.returncode}"
            aborted = self._abort_line(host)
            if aborted is not None:
                return f"a Ray process aborted: {aborted}"
            if time.monotonic() > deadline:
                return "timeout: the node was not up in time"
            time.sleep(0.2)
        return None

    def _abort_line(self, host: TestHost) -> str | None:
        """The first fatal line (Ray's C or F log level) of the node's raylet or GCS, if any."""
        logs = self.node_dir(host) / "session_latest" / "logs"
        for name in ("raylet.out", "gcs_server.out"):
            try:
                text = (logs / name).read_text(errors="replace")
            except FileNotFoundError:
                continue
            match = _FATAL_LINE.search(text)
            if match is not None:
                return match.group(0)[:400]
        return None

    def _end_node(self, host: TestHost, proc: subprocess.Popen, attempt: int) -> None:
        """End a failed attempt: its processes, everything in the host's namespace, its temp dir."""
        tree = _tree(proc.pid)
        _signal_all(tree, signal.SIGKILL)
        kill_namespace_processes(host.name, grace_s=0.5)
        proc.wait()
        self._procs.remove(proc)
        self.log_path(host).rename(self.log_path(host).with_suffix(f".attempt{attempt}.log"))
        shutil.rmtree(self.node_dir(host), ignore_errors=True)

    def log_tail(self, host: TestHost, num_lines: int = 30) -> str:
        """The last lines of `host`'s `ray start` output, for error messages."""
        try:
            lines = self.log_path(host).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    # -- use ------------------------------------------------------------------------------------

    def driver_env(self, **extra: str) -> dict[str, str]:
        """The environment for a Ray driver run in host 0's namespace (the caller's, plus RAY_TMPDIR)."""
        return dict(os.environ, RAY_TMPDIR=str(self.node_dir(self.hosts[0])), **extra)

    def run_driver(self, code: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """Run Python `code` (with `args` in sys.argv[1:]) as a driver in host 0's namespace."""
        return self.hosts[0].run(
            [self.python, "-c", code, *args], env=self.driver_env(), capture_output=True, text=True,
            timeout=timeout_s, stdin=subprocess.DEVNULL,
        )

    def wait_until_nodes(self, num_nodes: int, timeout_s: float = 60.0) -> list[str]:
        """Block until `num_nodes` nodes are alive as a driver sees them; return their addresses."""
        out = self.run_driver(
            _COUNT_NODES, self.address, self.hosts[0].address, str(num_nodes), str(timeout_s),
            timeout_s=timeout_s + 60.0,
        )
        try:
            alive = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            alive = None
        if out.returncode != 0 or alive is None:
            raise TimeoutError(
                f"{num_nodes} Ray nodes not alive within {timeout_s} s (alive: {alive}); driver exited "
                f"{out.returncode}:\n{out.stderr[-3000:]}"
            )
        return alive

    # -- stop -----------------------------------------------------------------------------------

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 1.0) -> None:
        """End the nodes, then every process left in the cluster's namespaces. Safe to call twice.

        SIGTERM goes to each `ray start` and the processes under it at once; what has not exited
        after `grace_s` is killed, and then so is anything else still running in the namespaces,
        Ray's or started through it. The grace is short because it is seldom enough: a `ray start`
        drains its node for up to 30 s first, and on a loaded machine a GCS and raylets were
        seen still running long after their SIGTERM. SIGKILL leaves nothing behind in /dev/shm.
        """
        if self._stopped:
            return
        self._stopped = True
        trees = [_tree(proc.pid) for proc in self._procs]
        for tree in trees:
            _signal_all(tree, signal.SIGTERM)
        _, alive = psutil.wait_procs([p for tree in trees for p in tree], timeout=grace_s)
        _signal_all(alive, signal.SIGKILL)
        kill_namespace_processes(self.hosts.names, grace_s=1.0)
        for proc in self._procs:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                logger.warning("ray start (pid %d) did not exit after SIGKILL", proc.pid)
        if not self._keep_temp:
            _remove_tree(self.temp_dir)


def _write_agent_port_files(ray_start_pid: int) -> bool:
    """Write the agents' port files for the raylet under `ray_start_pid`, unless they exist yet.

    A raylet reads two ports from files its Python agents write once they are up, and aborts if a
    file is missing after a fixed 15 s, which the dashboard agent's start can exceed on a loaded
    machine. Both values are known before the agents start: the runtime env agent's port is
    the fixed one it was given, and the dashboard agent of Ray's minimal install (what the `ray`
    extra installs) serves no HTTP, which it records as -1. Writing them first lets the raylet go
    on; the agents overwrite them with the same values. Returns whether the raylet was found.
    A Ray release that names these files differently finds them absent and waits as before.
    """
    raylet = next((p for p in _tree(ray_start_pid) if p.name() == "raylet"), None)
    if raylet is None:
        return False
    try:
        flags = dict(arg[2:].split("=", 1) for arg in raylet.cmdline() if arg.startswith("--") and "=" in arg)
    except psutil.NoSuchProcess:
        return False
    node_id, session_dir = flags.get("node_id"), flags.get("session_dir")
    if not node_id or not session_dir:
        return False
    for name, port in AGENT_PORT_FILES.items():
        path = Path(session_dir) / f"{name}_{node_id}"
        if not path.exists():
            scratch = path.with_name(f".{path.name}.f2nb")
            scratch.write_text(str(port))
            os.replace(scratch, path)  # never a half-written file for the raylet to read
    return True


def _tree(pid: int) -> list[psutil.Process]:
    """`pid` and everything under it, as it is now."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _remove_tree(path: Path) -> None:
    """Remove `path`, again if a process that just died had still been writing under it."""
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.2)
    logger.warning("could not remove %s", path)
