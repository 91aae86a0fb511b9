"""The standby agent: a launch hands it the plan, a changed environment, an upgraded package or
`close()` ends it, and
the orphan registry knows it while it waits. A stand-in agent records what it was handed."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from fsdp2nb.host.process_identity import process_key
from fsdp2nb.pool import reaper
from fsdp2nb.pool.launcher import LocalLauncher
from fsdp2nb.wire.launch_plan import LaunchPlan, RankPlan

# Stands in for `python -m fsdp2nb.worker.agent`: reads its request as the agent does (only once it
# has "imported"), then writes "<pid> <request>" where the test can read it.
_FAKE_AGENT = ("import os, sys\nrequest = sys.stdin.buffer.readline().rstrip(b'\\n')\n"
               "with open(os.environ['FAKE_AGENT_OUT'], 'ab') as out:\n"
               "    out.write(str(os.getpid()).encode() + b' ' + request + b'\\n')\n")


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_AGENT_OUT", str(tmp_path / "handed.txt"))
    launcher = LocalLauncher(command=(sys.executable, "-c", _FAKE_AGENT))
    yield launcher
    launcher.close()


def _plan(tmp_path) -> LaunchPlan:
    return LaunchPlan(pool_id="test-standby", world_size=1, backend="gloo",
                      ranks=(RankPlan(rank=0, local_rank=0, device="cpu"),), address="", runtime_dir=str(tmp_path),
                      log_dir=str(tmp_path), collective_timeout_s=1.0, kernel_pid=os.getpid(), master_port=0)


def _handed(tmp_path) -> dict[int, dict]:
    lines = (tmp_path / "handed.txt").read_bytes().splitlines()
    return {int(pid): json.loads(request) for pid, request in (line.split(b" ", 1) for line in lines)}


def _registry_entry(standby_id: str) -> dict | None:
    path = reaper.state_dir() / "pools" / f"{standby_id}.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_launch_hands_its_plan_to_the_waiting_standby(launcher, tmp_path):
    launcher.start_standby()
    standby = launcher._standby
    entry = _registry_entry(standby.standby_id)
    assert entry is not None and entry["owner"][0] == os.getpid()  # a later pool reaps it if this kernel dies
    assert [pid for pid, _ in entry["processes"]] == [standby.process.pid]
    agent = launcher.launch(_plan(tmp_path), b"key")
    assert agent.process_ids() == [standby.process.pid]
    assert agent.process.wait(timeout=10) == 0
    assert _handed(tmp_path)[standby.process.pid]["plan"]["pool_id"] == "test-standby"
    assert launcher.standby_pid() is None  # used up: the next one starts once the pool is ready
    assert _registry_entry(standby.standby_id) is None  # now the pool's agent, registered by the pool


def test_a_standby_from_another_environment_is_ended_and_a_fresh_agent_started(launcher, tmp_path, monkeypatch):
    launcher.start_standby()
    standby = launcher._standby
    monkeypatch.setenv("SET_AFTER_THE_STANDBY_STARTED", "1")  # a fresh agent would see it; the standby not
    agent = launcher.launch(_plan(tmp_path), b"key")
    assert agent.process_ids() != [standby.process.pid]
    assert agent.process.wait(timeout=10) == 0
    assert standby.process.poll() is not None and list(_handed(tmp_path)) == [agent.process.pid]
    assert not standby.log_dir.exists() and _registry_entry(standby.standby_id) is None


def test_a_standby_started_before_an_upgrade_is_ended_and_a_fresh_agent_started(launcher, tmp_path, monkeypatch):
    launcher.start_standby()
    standby = launcher._standby
    upgraded = tuple((name, origin, (changed or 0) + 1) for name, origin, changed in standby.installed)
    monkeypatch.setattr("fsdp2nb.pool.launcher.installed_packages", lambda: upgraded)  # `%pip install -U torch`
    agent = launcher.launch(_plan(tmp_path), b"key")
    assert agent.process_ids() != [standby.process.pid]
    assert agent.process.wait(timeout=10) == 0
    assert standby.process.poll() is not None and list(_handed(tmp_path)) == [agent.process.pid]


def test_close_ends_the_standby_and_is_safe_twice(launcher):
    launcher.start_standby()
    standby = launcher._standby
    launcher.start_standby()
    assert launcher._standby is standby  # one waits already: no second
    launcher.close()
    launcher.close()
    assert standby.process.poll() is not None and launcher.standby_pid() is None
    assert not standby.log_dir.exists() and _registry_entry(standby.standby_id) is None


def test_a_standby_that_ended_before_its_plan_is_replaced_by_a_fresh_agent(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_AGENT_OUT", str(tmp_path / "handed.txt"))
    exits_as_standby = "import sys\nif '--standby-log' in sys.argv:\n    sys.exit(3)\n" + _FAKE_AGENT
    launcher = LocalLauncher(command=(sys.executable, "-c", exits_as_standby))
    try:
        launcher.start_standby()
        standby = launcher._standby
        standby.process.wait(timeout=10)
        standby.usable = lambda environment: True  # as if it ended just after being checked
        agent = launcher.launch(_plan(tmp_path), b"key")  # the plan meets a closed pipe
        assert agent.process.wait(timeout=10) == 0 and list(_handed(tmp_path)) == [agent.process.pid]
        assert not standby.log_dir.exists() and _registry_entry(standby.standby_id) is None
    finally:
        launcher.close()


def test_the_reaper_ends_the_standby_of_a_dead_kernel(launcher):
    launcher.start_standby()
    standby = launcher._standby
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner = process_key(gone.pid)
    gone.wait()
    entry = _registry_entry(standby.standby_id)
    reaper.record_pool(standby.standby_id, dead_owner, [tuple(p) for p in entry["processes"]],
                       runtime_dir=entry["runtime_dir"])
    reaper.reap_orphans()
    assert standby.process.wait(timeout=10) == -signal.SIGKILL
    assert not standby.log_dir.exists() and _registry_entry(standby.standby_id) is None


# A kernel that starts a real standby agent, forks a child that keeps the standby's stdin open (as
# a forked multiprocessing worker would), then ends: the standby must end too, with no end of file.
_KERNEL_THAT_DIES = """
import os, subprocess, sys, time
agent = subprocess.Popen([sys.executable, "-m", "fsdp2nb.worker.agent", "--standby-log", sys.argv[1],
                          "--kernel-pid", str(os.getpid())], stdin=subprocess.PIPE, start_new_session=True)
holder = os.fork()
if holder == 0:
    time.sleep(120)
    os._exit(0)
with open(sys.argv[2], "w") as pids:
    pids.write(f"{agent.pid} {holder}")
os._exit(0)
"""


def test_a_standby_ends_with_its_kernel_even_while_its_stdin_is_held_open(tmp_path):
    log_dir = tmp_path / "standby-test"
    log_dir.mkdir()
    subprocess.run([sys.executable, "-c", _KERNEL_THAT_DIES, str(log_dir / "agent.log"), str(tmp_path / "pids")],
                   stdout=subprocess.DEVNULL, timeout=30, env={**os.environ, "PYTHONPATH": os.getcwd()}, check=True)
    agent_pid, holder_pid = map(int, (tmp_path / "pids").read_text().split())
    try:
        agent = psutil.Process(agent_pid)
        _, alive = psutil.wait_procs([agent], timeout=60)  # it imports torch first
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], "the standby outlived its kernel"
        assert psutil.pid_exists(holder_pid)  # the pipe's other end was still open all along
        assert not log_dir.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder_pid, signal.SIGKILL)
