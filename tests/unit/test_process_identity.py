"""A process is known by (pid, start after boot): a step of the wall clock, which moves Linux's
boot time by a second, must not make a live rank, agent or kernel look gone."""

import subprocess
import sys
import time

import psutil
import psutil._pslinux
import pytest

from fsdp2nb.host import memory_store
from fsdp2nb.host.process_identity import is_same_process, own_process_key, process_key, start_time
from fsdp2nb.pool import reaper
from fsdp2nb.pool.rank_processes import rank_process_state
from fsdp2nb.wire.events import RankReady


def _step_the_clock(monkeypatch) -> None:
    """The wall clock steps by one second: the boot time psutil reads (/proc/stat's btime, the
    wall clock minus the uptime) moves with it."""
    stepped = psutil.boot_time() + 1.0
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
    monkeypatch.setattr(psutil, "boot_time", lambda: stepped)


@pytest.fixture
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def test_a_live_rank_stays_itself_after_the_clock_steps(sleeper, monkeypatch):
    pid, started = process_key(sleeper.pid)
    info = RankReady(rank=0, pid=pid, start_time=started, device="cpu", hostname="host", log_path="")
    _step_the_clock(monkeypatch)
    assert rank_process_state(info) in ("running", "sleeping")
    assert reaper.is_alive((pid, started))
    sleeper.kill()
    sleeper.wait()
    assert rank_process_state(info) == ""
    assert not reaper.is_alive((pid, started))


def test_a_kernels_memory_store_survives_a_sweep_after_the_clock_steps(tmp_path, monkeypatch):
    monkeypatch.setenv(memory_store.SHARED_MEMORY_DIR_ENV, str(tmp_path))
    mine = memory_store.session_store(*own_process_key())  # its start kept in milliseconds, in its name
    mine.mkdir()
    _step_the_clock(monkeypatch)
    memory_store.sweep_stores(lambda pid, started: reaper.is_alive((pid, started)))
    assert mine.is_dir()


def test_the_start_is_read_past_a_command_name_with_spaces_and_parentheses():
    code = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) (y z', 0, 0, 0); "  # 15: PR_SET_NAME
            "print('named', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "named\n"
        assert open(f"/proc/{child.pid}/comm").read() == "x) (y z\n"
        started = start_time(child.pid)
        assert started == pytest.approx(psutil.Process(child.pid).create_time() - psutil.boot_time(), abs=0.02)
        assert 0 < started <= time.clock_gettime(time.CLOCK_BOOTTIME)
    finally:
        child.kill()
        child.wait()


def test_an_ended_process_is_no_longer_the_one_recorded():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    key = process_key(child.pid)
    child.wait()
    assert start_time(child.pid) is None and process_key(child.pid) is None
    assert not is_same_process(key)
    assert is_same_process(own_process_key())
