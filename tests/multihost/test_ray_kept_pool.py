"""A kept pool across two Ray hosts (`--ray ... --keep`): it outlives a SIGKILLed kernel, a new
kernel attaches and finds rank state, and its end (`%fsdp2 stop`, `--keep-for` while no kernel
holds it, or its driver killed) frees what it held in Ray. Kernels run in host 0's namespace, as in test_ray_pool.py;
each test gives its kernels a TMPDIR of its own, so kept pools of other tests are never seen.
"""

import json
import os
import shutil
import signal
import tempfile
import textwrap
import time

import psutil
import pytest

from tests.support.host_processes import pool_processes, wait_for_no_pool_processes
from tests.support.kernel_client import WITHOUT_GPUS, Kernel, kernels_with_fsdp2nb

pytestmark = pytest.mark.timeout(900)  # the package's Ray cluster starts inside the first test

START = "%fsdp2 start --ray {address} --nodes 2 --cpu-per-node 1 --no-dashboard --keep --name {name}"

# Prints, as JSON, which of the pool's actors and its placement group Ray still has, and whether
# every CPU of the cluster is free again (the pool's bundles held one per host).
_RAY_STATE = textwrap.dedent("""
    import json, sys, time
    import ray
    from ray.util import get_placement_group
    ray.init(address=sys.argv[1], namespace="fsdp2nb", logging_level="ERROR", log_to_driver=False)
    name = sys.argv[2]
    actors = []
    for node in range(2):
        try:
            ray.get_actor(f"{name}-node{node}")
            actors.append(node)
        except ValueError:
            pass
    try:
        get_placement_group(name)
        placement = True
    except ValueError:
        placement = False
    wait_s = float(sys.argv[3])
    deadline = time.monotonic() + wait_s
    while True:  # Ray frees resources a moment after the placement group goes
        free = ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0)
        if free or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(json.dumps({"actors": actors, "placement_group": placement, "cpus_free": free}))
    ray.shutdown()
""")


@pytest.fixture
def kept_env(ray_cluster):
    root = tempfile.mkdtemp(prefix="rk-")
    yield {**ray_cluster.driver_env(), **WITHOUT_GPUS, "TMPDIR": root}
    for meta in _metas(root):  # end what a failed test left running
        try:
            os.kill(meta["agent"][0], signal.SIGTERM)
        except OSError:
            pass
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kernels(kept_env, test_hosts):
    with kernels_with_fsdp2nb(kept_env, argv_prefix=test_hosts[0].exec_prefix()) as start:
        yield start


def _metas(root: str) -> list[dict]:
    base = os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept")
    metas = []
    for name in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, name, "pool.json")) as meta:
                metas.append(json.load(meta))
        except (OSError, ValueError):
            pass
    return metas


def _ray_state(ray_cluster, pool_id: str, wait_s: float = 0.0) -> dict:
    run = ray_cluster.run_driver(_RAY_STATE, ray_cluster.address, f"fsdp2nb-{pool_id}", str(wait_s))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _start_kept(kernel: Kernel, ray_cluster, name: str, extra: str = "") -> dict:
    run = kernel.execute(START.format(address=ray_cluster.address, name=name) + extra, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    [meta] = [meta for meta in _metas(kernel_tmpdir(kernel)) if meta["name"] == name]
    return meta


def kernel_tmpdir(kernel: Kernel) -> str:
    return psutil.Process(kernel.pid).environ()["TMPDIR"]


def test_a_kept_ray_pool_outlives_a_killed_kernel_and_stop_frees_ray(kernels, test_hosts, ray_cluster):
    others = {process.pid for process in pool_processes(test_hosts)}
    first = kernels()
    meta = _start_kept(first, ray_cluster, "rk")
    assert meta["placement"]["engine"] == "ray" and meta["listen"] == test_hosts[0].address
    assert first.execute("%%fsdp2\nsecret = 100 + rank").status == "ok"
    mine = [process for process in pool_processes(test_hosts) if process.pid not in others]
    assert len(mine) == 5  # the driver, two agents, two ranks

    os.kill(first.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(first.pid)], timeout=30)
    assert all(process.is_running() for process in mine)
    assert _ray_state(ray_cluster, meta["pool_id"]) == {"actors": [0, 1], "placement_group": True,
                                                         "cpus_free": False}

    second = kernels()
    pools = second.execute("%fsdp2 pools").result_text
    assert "rk: --ray" in pools and "--nodes 2" in pools, pools
    attached = second.execute("%fsdp2 attach rk", timeout=300)
    assert attached.status == "ok", attached.traceback_text + attached.stderr
    read = second.execute("%%fsdp2\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(secret, int(x.item()))")
    assert sorted(read.stdout.splitlines()) == ["[0] 100 2", "[1] 101 2"], read.stdout + read.stderr
    assert f"held by kernel {second.pid}" in second.execute("%fsdp2 pools").result_text

    stopped = second.execute("%fsdp2 stop", timeout=300)
    assert stopped.status == "ok", stopped.traceback_text + stopped.stderr
    _, alive = psutil.wait_procs(mine, timeout=90)
    assert alive == []
    with open(os.path.join(meta["log_dir"], "ray-driver.log")) as log:  # its reports, once its kernel was gone
        reports = log.read()
    assert '{"stopped": true}' in reports and '"error"' not in reports, reports[-3000:]
    assert _ray_state(ray_cluster, meta["pool_id"], wait_s=60) == {"actors": [], "placement_group": False,
                                                                    "cpus_free": True}
    assert second.execute("%fsdp2 pools").result_text == "no kept pools"


@pytest.mark.soak  # the same on one host: tests/kernel/test_kept_pools.py
def test_restart_stays_kept_and_a_detached_idle_pool_ends_after_keep_for(kernels, test_hosts, ray_cluster):
    kernel = kernels()
    before = _start_kept(kernel, ray_cluster, "brief", extra=" --keep-for 3s")
    restarted = kernel.execute("%fsdp2 restart", timeout=300)
    assert restarted.status == "ok", restarted.traceback_text + restarted.stderr
    [meta] = _metas(kernel_tmpdir(kernel))
    assert meta["name"] == "brief" and meta["pool_id"] != before["pool_id"] and meta["keep_for_s"] == 3
    assert _ray_state(ray_cluster, before["pool_id"], wait_s=0)["actors"] == []
    driver = psutil.Process(meta["agent"][0])
    assert kernel.execute("%fsdp2 detach").status == "ok"
    assert driver.is_running()
    driver.wait(timeout=240)  # the agents' clocks run out; the driver ends the pool
    assert wait_for_no_pool_processes(test_hosts, timeout_s=90) == []
    # the driver removed the pool's directory, and the agents their hosts' (node-N/, inside it here)
    assert not os.path.exists(os.path.join(kernel_tmpdir(kernel), f"fsdp2nb-{os.getuid()}", "kept", "brief"))
    assert _ray_state(ray_cluster, meta["pool_id"], wait_s=60) == {"actors": [], "placement_group": False,
                                                                    "cpus_free": True}
    assert kernel.execute("%fsdp2 pools").result_text == "no kept pools"


@pytest.mark.soak  # the same on one host: tests/kernel/test_kept_pools.py
def test_a_run_of_the_killed_kernel_is_picked_up_take_moves_the_pool_and_a_killed_driver_ends_it(
        kernels, test_hosts, ray_cluster, tmp_path):
    """The hosts' activity reaches the kernel that attaches: it gets a handle on the run the lost
    kernel started; a third kernel is refused, then takes the pool and the run with it. Then the
    driver is killed: the pool ends with it, and Ray frees what it held."""
    flag, started = tmp_path / "go-on", tmp_path / "started"  # one filesystem for both hosts
    started.mkdir()
    others = {process.pid for process in pool_processes(test_hosts)}
    first = kernels()
    meta = _start_kept(first, ray_cluster, "run")
    mine = [process for process in pool_processes(test_hosts) if process.pid not in others]
    code = (f"%%fsdp2 --bg --name train\nimport os, time\nopen(os.path.join({str(started)!r}, str(rank)), 'w').close()\n"
            f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.1)\ndone = rank")
    assert first.execute(code).status == "ok"
    while len(os.listdir(started)) < 2:  # both ranks run it
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(first.pid)], timeout=30)

    second = kernels()
    attached = second.execute("%fsdp2 attach run --no-dashboard", timeout=300)
    assert attached.status == "ok" and "is still running" in attached.stdout, attached.stdout + attached.stderr
    third = kernels()
    refused = third.execute("%fsdp2 attach run --no-dashboard")
    lines = [line for line in refused.stderr.splitlines() if line.startswith("UsageError")]
    assert len(lines) == 1 and f"held by kernel {second.pid}" in lines[0] and "--take" in lines[0], refused.stderr

    taken = third.execute("%fsdp2 attach run --take --no-dashboard", timeout=300)
    assert taken.status == "ok" and "is still running" in taken.stdout, taken.stdout + taken.stderr
    flag.touch()
    assert third.execute("%fsdp2 wait", timeout=120).status == "ok"
    assert third.execute("%%fsdp2\nprint(done)").stdout == "[0] 0\n[1] 1\n"
    old = second.execute("%%fsdp2\nprint(done)")  # the old holder: its handle on the run ended, saying why
    assert old.status == "error" and f"was taken by kernel {third.pid}" in old.error["evalue"], old.error["evalue"]

    assert third.execute("%fsdp2 detach").status == "ok"
    os.kill(meta["agent"][0], signal.SIGKILL)
    _, alive = psutil.wait_procs(mine, timeout=120)  # the actors die with the driver's job, the agents with them
    assert alive == []
    assert _ray_state(ray_cluster, meta["pool_id"], wait_s=60) == {"actors": [], "placement_group": False,
                                                                    "cpus_free": True}
    assert third.execute("%fsdp2 pools").result_text == "no kept pools"
    run = third.execute("%fsdp2 attach run")
    assert run.status == "error" and "no kept pool is named 'run'" in run.stderr, run.stderr
