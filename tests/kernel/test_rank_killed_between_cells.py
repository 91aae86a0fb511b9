"""A rank killed between cells: the next cell restarts the pool, says what died and what is kept,
and runs on every rank, as after a rank killed inside a cell or a dead host agent. On a plain
pool with snapshots in host memory, after `%fsdp2 restart`, and on a kept pool."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid

import pytest

from tests.support import training_cells
from tests.support.host_processes import wait_until_ended
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

pytestmark = pytest.mark.timeout(600)

SETUP = training_cells.SETUP.replace("keep=2)", "keep=2, memory_every=1)")
assert "memory_every=1" in SETUP, "the training tests' set-up cell makes its Checkpointer so"

TRAIN_TO_2 = """%%fsdp2
for step in range(3):
    train_step(step)
    ckpt.maybe_save(step)
ckpt.wait()
"""

NEXT_CELL = "%%fsdp2\nprint('ran', 'kept' in globals())"


def _ok(kernel: Kernel, code: str, timeout: float = 300):
    run = kernel.execute(code, timeout=timeout)
    assert run.status == "ok", run.traceback_text or run.stderr
    return run


def _rank_pid(kernel: Kernel, rank: int) -> int:
    return int(_ok(kernel, f"%%fsdp2 --ranks {rank}\nimport os\nkept = 1\nprint(os.getpid())").stdout.split()[-1])


def _kill_between_cells(kernel: Kernel, rank: int) -> None:
    """SIGKILL `rank` while no cell runs, then wait until the kernel has heard of its exit."""
    pid = _rank_pid(kernel, rank)
    os.kill(pid, signal.SIGKILL)
    wait_until_ended(pid)
    for _ in range(600):  # the agent's report arrives on the kernel's receiving thread
        if "exited" in _ok(kernel, "%fsdp2 status").stdout:
            return
    raise AssertionError(f"the kernel never heard that rank {rank} (pid {pid}) exited")


def _assert_restarted_and_ran(kernel: Kernel, rank: int) -> str:
    """The next cell runs on every rank of a fresh pool; returns what it said on stderr."""
    run = kernel.execute(NEXT_CELL, timeout=300)
    assert run.status == "ok", run.traceback_text or run.stderr
    assert run.stdout == "[all] ran False\n", run.stdout
    said = run.stderr
    assert f"rank {rank} exited, killed by SIGKILL" in said and "while the pool was idle" in said, said
    assert "the pool was restarted (--cpu 2)" in said, said
    assert "%fsdp2 restart` starts a fresh" not in said
    return said


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    _ok(k, "%fsdp2 start --cpu 2 --no-dashboard")
    yield k
    k.stop()


def test_a_rank_killed_between_cells_restarts_the_pool_and_says_what_is_kept(kernel, tmp_path):
    _ok(kernel, f"%%fsdp2\nmodel_dir = {str(tmp_path / 'model')!r}\nckpt_dir = {str(tmp_path / 'ckpt')!r}\n")
    _ok(kernel, SETUP)
    _ok(kernel, TRAIN_TO_2)
    _kill_between_cells(kernel, 1)
    said = _assert_restarted_and_ran(kernel, 1)
    assert "step 2 of" in said and "is kept in memory" in said, said


def test_after_a_restart_a_rank_killed_between_cells_restarts_the_pool(kernel):
    _ok(kernel, "%fsdp2 restart")
    _kill_between_cells(kernel, 0)
    said = _assert_restarted_and_ran(kernel, 0)
    assert "step 2 of" in said, said  # the session's snapshots outlive its restarts


def test_a_kept_pool_whose_rank_was_killed_between_cells_restarts_kept():
    root = tempfile.mkdtemp(prefix="rk-")  # short: the kernel's Unix socket lives under it
    name = f"rk-{uuid.uuid4().hex[:6]}"
    k = Kernel(env={**WITHOUT_GPUS, "TMPDIR": root})
    try:
        assert k.execute("%load_ext fsdp2nb").status == "ok"
        _ok(k, f"%fsdp2 start --cpu 2 --keep --name {name} --no-dashboard")
        _kill_between_cells(k, 1)
        _assert_restarted_and_ran(k, 1)
        pools = _ok(k, "%fsdp2 pools").result_text
        assert pools.startswith(f"{name}: --cpu 2, held by kernel {k.pid}"), pools
        _ok(k, "%fsdp2 stop")
    finally:
        k.stop()
        shutil.rmtree(root, ignore_errors=True)
