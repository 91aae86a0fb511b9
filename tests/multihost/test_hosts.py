"""The test hosts themselves: namespaces that behave as separate hosts, Ray across them, fake srun."""

import json
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.support.fake_srun import write_srun
from tests.support.netns import TestHost, TestHosts, list_namespaces

# Listens on (argv[1], any port), prints the port, answers one connection with its peer's address
# followed by what it received.
_ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], 0))
    print(server.getsockname()[1], flush=True)
    conn, peer = server.accept()
    conn.sendall(peer[0].encode() + b" " + conn.recv(100))
""")
# Connects to (argv[1], argv[2]), sends "ping", prints the answer or the error's class name.
_ECHO_CLIENT = textwrap.dedent("""
    import socket, sys
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
        conn.sendall(b"ping")
        print(conn.recv(100).decode())
    except OSError as exc:
        print(type(exc).__name__)
""")


def _python(host: TestHost, code: str, *args: str) -> str:
    out = host.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _echo_server(host: TestHost, bind: str) -> tuple[subprocess.Popen, int]:
    server = host.popen([sys.executable, "-c", _ECHO_SERVER, bind], stdout=subprocess.PIPE, text=True)
    return server, int(server.stdout.readline())


def test_hosts_have_their_own_addresses_and_no_default_route(test_hosts):
    assert [h.address for h in test_hosts] == ["10.213.0.1", "10.213.0.2"]
    for host in test_hosts:
        addrs = host.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
        # lo and the veth only, the host's address on the veth.
        assert {line.split()[1] for line in addrs.splitlines()} == {"lo", host.interface}
        assert f"inet {host.address}/24" in addrs
        routes = host.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
        assert "default" not in routes
        assert os.readlink(f"/proc/{os.getpid()}/ns/net") != _python(
            host, "import os; print(os.readlink('/proc/self/ns/net'))")


def test_host_1_reaches_host_0_over_the_veth(test_hosts):
    server, port = _echo_server(test_hosts[0], test_hosts[0].address)
    try:
        answer = _python(test_hosts[1], _ECHO_CLIENT, test_hosts[0].address, str(port))
    finally:
        server.kill()
        server.wait()
    assert answer == f"{test_hosts[1].address} ping"  # from host 1's own address, not a NAT or lo


def test_host_1_cannot_reach_host_0_loopback_services(test_hosts):
    server, port = _echo_server(test_hosts[0], "127.0.0.1")
    try:
        assert _python(test_hosts[1], _ECHO_CLIENT, "127.0.0.1", str(port)) == "ConnectionRefusedError"
        assert _python(test_hosts[1], _ECHO_CLIENT, test_hosts[0].address, str(port)) == "ConnectionRefusedError"
        # The service is there for host 0 itself, so the refusals above are the namespaces' doing.
        assert _python(test_hosts[0], _ECHO_CLIENT, "127.0.0.1", str(port)) == "127.0.0.1 ping"
    finally:
        server.kill()
        server.wait()


def test_close_leaves_no_namespace_and_no_process():
    reason = TestHosts.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no test hosts: {reason}")
    hosts = TestHosts(3, grace_s=1.0)  # 3: the bridge layout, with its switch namespace
    names = hosts.namespaces
    assert len(names) == 4 and set(names) <= set(list_namespaces())
    for host in hosts:
        # One process that exits on SIGTERM and one that ignores it, detached from this process.
        host.run(["sh", "-c", "sleep 1000 & (trap '' TERM; exec sleep 1001) &"], check=True)
    deadline = time.monotonic() + 10
    while not all(len(h.pids()) >= 2 for h in hosts) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [pid for h in hosts for pid in h.pids()]
    assert len(pids) >= 6
    hosts.close()
    assert not set(names) & set(list_namespaces())
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    hosts.close()  # twice is safe
    assert hosts.namespaces == []


_STRICT_SPREAD = textwrap.dedent("""
    import json, sys
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2], logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=1)
    class Where:
        def ip(self):
            return ray.util.get_node_ip_address()

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(group.ready(), timeout=60)
    actors = [
        Where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
        for i in range(2)
    ]
    print(json.dumps(ray.get([a.ip.remote() for a in actors], timeout=60)))
""")


@pytest.mark.timeout(600)  # the first Ray test also starts the cluster: 50-80 s, more on a loaded machine
def test_ray_strict_spread_puts_one_actor_on_each_host(ray_cluster, test_hosts):
    out = ray_cluster.run_driver(_STRICT_SPREAD, ray_cluster.address, test_hosts[0].address, timeout_s=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(json.loads(out.stdout.strip().splitlines()[-1])) == ["10.213.0.1", "10.213.0.2"]


_REPORT_TASK = (  # one write per task: the two tasks share srun's stdout, and print() may write piecewise
    "import os, sys; words = (os.environ['SLURM_NODEID'], os.environ['SLURM_PROCID'], os.environ['SLURM_NNODES'], "
    "os.environ['SLURMD_NODENAME'], os.readlink('/proc/self/ns/net'), sys.stdin.read().strip()); "
    "os.write(1, (' '.join(words) + '\\n').encode())"
)


def _srun(directory, hosts: TestHosts, *args: str, **kwargs) -> subprocess.CompletedProcess:
    write_srun(directory, hosts.names)
    env = dict(os.environ, PATH=f"{directory}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["srun", *args], env=env, capture_output=True, text=True, timeout=60, **kwargs)


def test_fake_srun_starts_one_task_per_host_with_stdin_copied(test_hosts, tmp_path):
    out = _srun(tmp_path, test_hosts, "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                "--input", "all", sys.executable, "-c", _REPORT_TASK, input="the plan\n")
    assert out.returncode == 0, out.stderr
    rows = sorted(line.split(" ", 5) for line in out.stdout.splitlines())
    expected = []
    for host in test_hosts:
        netns = f"net:[{os.stat(f'/var/run/netns/{host.name}').st_ino}]"
        expected.append([str(host.index), str(host.index), "2", host.name, netns, "the plan"])
    assert rows == expected


def test_fake_srun_ends_every_task_when_one_fails(test_hosts, tmp_path):
    task = "if [ $SLURM_NODEID = 1 ]; then exit 7; fi; trap '' TERM; exec sleep 1000"
    started = time.monotonic()
    out = _srun(tmp_path, test_hosts, "-N", "2", "--kill-on-bad-exit=1", "sh", "-c", task,
                stdin=subprocess.DEVNULL)
    assert out.returncode == 7, out.stderr
    assert time.monotonic() - started < 30  # the SIGTERM-ignoring task got SIGKILL after 3 s
    left = [pid for h in test_hosts for pid in h.pids() if "sleep" in _cmdline(pid)]
    assert left == []


def test_fake_srun_passes_sigterm_on_to_every_task(test_hosts, tmp_path):
    write_srun(tmp_path, test_hosts.names)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    srun = subprocess.Popen(["srun", "-N", "2", "sleep", "1002"], env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(_sleeps(h, "1002") for h in test_hosts):
            time.sleep(0.05)
        assert all(_sleeps(h, "1002") for h in test_hosts)
        srun.terminate()
        assert srun.wait(timeout=10) == 128 + 15  # the tasks' status: ended by SIGTERM
        assert not any(_sleeps(h, "1002") for h in test_hosts)
    finally:
        srun.kill()
        srun.wait()


def _sleeps(host: TestHost, seconds: str) -> list[int]:
    return [pid for pid in host.pids() if _cmdline(pid) == f"sleep {seconds}"]


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return ""
