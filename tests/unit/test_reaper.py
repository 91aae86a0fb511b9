import os
import shutil
import subprocess
import sys
import time

from fsdp2nb.host.process_identity import process_key
from fsdp2nb.pool import reaper


def _finished_process_key():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    key = process_key(done.pid)
    done.wait()
    return key


def test_orphans_of_a_dead_owner_are_killed_only_on_an_exact_match():
    owner = _finished_process_key()
    orphan = subprocess.Popen(["sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        orphan_key = process_key(orphan.pid)
        bystander_pid, bystander_time = process_key(bystander.pid)
        # The bystander's pid is listed with another start time: a reused pid must be left alone.
        reaper.record_pool("test-orphans", owner, [orphan_key, (bystander_pid, bystander_time - 100)])
        assert reaper.reap_orphans() >= 1
        assert orphan.wait(timeout=5) != 0
        assert bystander.poll() is None
    finally:
        for process in (orphan, bystander):
            process.kill()
            process.wait()
        reaper.forget_pool("test-orphans")


def test_a_process_that_ended_but_was_not_collected_is_not_reaped(caplog):
    owner = _finished_process_key()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    key = process_key(ended.pid)
    while reaper.psutil.Process(ended.pid).status() != reaper.psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    try:
        reaper.record_pool("test-zombie", owner, [key])
        with caplog.at_level("WARNING", logger=reaper.__name__):
            reaper.reap_orphans()
        assert f"process {ended.pid}" not in caplog.text  # it was not running: nothing was "ended"
    finally:
        ended.wait()
        reaper.forget_pool("test-zombie")


def test_pools_of_a_live_owner_are_left_alone():
    worker = subprocess.Popen(["sleep", "60"])
    try:
        reaper.record_pool("test-live", process_key(worker.pid), [process_key(worker.pid)])
        reaper.reap_orphans()
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()
        reaper.forget_pool("test-live")


def test_old_logs_go_but_those_of_a_running_pool_stay():
    logs = reaper.state_dir() / "logs"
    old = time.time() - reaper.LOG_RETENTION_S - 3600
    for pool_id in ("test-logs-running", "test-logs-gone"):
        (logs / pool_id).mkdir(parents=True, exist_ok=True)
        os.utime(logs / pool_id, (old, old))  # appending to a rank's log leaves its directory's time
    reaper.record_pool("test-logs-running", process_key(os.getpid()), [])
    try:
        reaper.reap_orphans()
        assert (logs / "test-logs-running").exists()
        assert not (logs / "test-logs-gone").exists()
    finally:
        reaper.forget_pool("test-logs-running")
        shutil.rmtree(logs / "test-logs-running", ignore_errors=True)


def test_runtime_dir_of_a_dead_owner_is_removed(tmp_path):
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir()
    reaper.record_pool("test-dir", _finished_process_key(), [], runtime_dir=str(runtime_dir))
    reaper.reap_orphans()
    assert not runtime_dir.exists()


def test_state_dir_refuses_a_link_put_in_its_place(tmp_path):
    import pytest

    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / f"fsdp2nb-{reaper.os.getuid()}").symlink_to(target)
    with pytest.raises(RuntimeError, match="not a directory owned by this user"):
        reaper.state_dir(str(tmp_path))


def test_state_dir_is_private(tmp_path):
    path = reaper.state_dir(str(tmp_path))
    assert path.stat().st_mode & 0o777 == 0o700
