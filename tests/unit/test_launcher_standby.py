"""The standby agent: a launch hands it the plan, a changed environment or `close()` ends it, and
the orphan registry knows it while it waits. A stand-in agent records what it was handed."""

import json
import os
import sys

import pytest

from fsdp2nb.pool import reaper
from fsdp2nb.pool.launcher import LocalLauncher
from fsdp2nb.wire.protocol import LaunchPlan, RankPlan

# Stands in for `python -m fsdp2nb.worker.agent`: reads its request as the agent does (only once it
# has "imported"), then writes "<pid> <request>" where the test can read it.
_FAKE_AGENT = ("import os, sys\nrequest = sys.stdin.buffer.read()\n"
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


def test_close_ends_the_standby_and_is_safe_twice(launcher):
    launcher.start_standby()
    standby = launcher._standby
    launcher.start_standby()
    assert launcher._standby is standby  # one waits already: no second
    launcher.close()
    launcher.close()
    assert standby.process.poll() is not None and launcher.standby_pid() is None
    assert not standby.log_dir.exists() and _registry_entry(standby.standby_id) is None
