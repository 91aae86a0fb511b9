"""Persisting at the breakpoint: a kernel killed (SIGKILL) while its ranks hold snapshots in host
memory leaves the newest one on disk, as an ordinary checkpoint, before that memory is freed.

The ranks train with a snapshot every step and a disk save every 5 steps; the kernel is killed at
step 7, between cells or while the training cell still runs. A new kernel's `load("latest")`
gives step 7, bitwise. A write that cannot finish within `FSDP2NB_PERSIST_ON_EXIT_S` is given
up: the store is freed anyway and the pool's log says so."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest

from fsdp2nb.checkpoint import layout
from tests.support import training_cells
from tests.support.host_processes import wait_until_ended
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

pytestmark = pytest.mark.timeout(600)

SETUP = training_cells.SETUP.replace("keep=2)", "keep=2, memory_every=1)") + """
import hashlib, os
from fsdp2nb.checkpoint.snapshot_layout import live_tensors

def digest():
    hashed = hashlib.sha256()
    for key, tensor in live_tensors(model, optimizer).items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        hashed.update(key.encode() + local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()[:16]
"""
assert "memory_every=1" in SETUP, "the training tests' set-up cell makes its Checkpointer so"

TRAIN_TO_7 = """%%fsdp2
for step in range(8):
    train_step(step)
    ckpt.maybe_save(step)
    if step % 5 == 0:
        ckpt.save(step)
ckpt.wait()
print("digest", digest())
"""

STAY_IN_THE_CELL = "\nimport time\ntime.sleep(600)\n"
"""Appended to TRAIN_TO_7: the kernel is killed while the cell still runs."""

RANK_1_DEAF = """
import signal, time
if rank == 1:
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])  # the stop never reaches it
time.sleep(600)
"""
"""Appended to TRAIN_TO_7: rank 1 never leaves the cell, so the snapshot is never written."""

LOAD_LATEST = """%%fsdp2
print("latest", ckpt.load("latest"))
print("digest", digest())
"""


def _ok(kernel: Kernel, code: str, timeout: float = 300):
    run = kernel.execute(code, timeout=timeout)
    assert run.status == "ok", run.traceback_text or run.stderr
    return run


def _by_rank(text: str, word: str) -> dict[str, str]:
    return dict(re.findall(rf"\[(\d)\] {word} (\S+)", text))


def _stream_text(messages: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def _set_up(kernel: Kernel, tmp_path: Path) -> None:
    _ok(kernel, "%load_ext fsdp2nb")
    _ok(kernel, "%fsdp2 start --cpu 2 --no-dashboard")
    _ok(kernel, f"%%fsdp2\nmodel_dir = {str(tmp_path / 'model')!r}\nckpt_dir = {str(tmp_path / 'ckpt')!r}\n")
    _ok(kernel, SETUP)


def _pool_of(kernel: Kernel) -> tuple[str, str, int]:
    """The pool's log directory, snapshot store and host agent's pid."""
    run = _ok(kernel, "import fsdp2nb\npool = fsdp2nb._session.pool\nprint(pool.log_dir)\nprint(pool.memory_dir)")
    log_dir, store = run.stdout.split()
    agent = int(_ok(kernel, "%%fsdp2 --ranks 0\nprint(os.getppid())").stdout.split()[-1])
    return log_dir, store, agent


def _train_to_7_and_kill(kernel: Kernel, tail: str) -> dict[str, str]:
    """Train steps 0-7 (disk saves at 0 and 5), then SIGKILL the kernel: after the cell where
    `tail` is empty, else once the cell printed its digest. Returns each rank's digest at 7."""
    if not tail:
        digests = _by_rank(_ok(kernel, TRAIN_TO_7).stdout, "digest")
    else:
        msg_id = kernel.submit(TRAIN_TO_7 + tail)
        printed = kernel.messages_for(msg_id, lambda messages: _stream_text(messages).count("digest") >= 1,
                                      timeout=300)
        digests = _by_rank(_stream_text(printed), "digest")
    os.kill(kernel.pid, signal.SIGKILL)
    assert len(digests) == 2 or set(digests) == {"all"}, digests
    return digests


def _end_killed(kernel: Kernel) -> None:
    """Let go of a kernel that was killed (a shutdown request would wait for its reply in vain)."""
    with contextlib.suppress(Exception):
        kernel.manager.provisioner.process.wait(timeout=10)
    kernel.client.stop_channels()
    with contextlib.suppress(Exception):
        kernel.manager.cleanup_resources()


def _digest_by_rank(digests: dict[str, str]) -> dict[str, str]:
    """`[all] digest X` (both ranks printed the same) as each rank's."""
    return {"0": digests["all"], "1": digests["all"]} if "all" in digests else digests


@pytest.mark.parametrize("tail", ["", STAY_IN_THE_CELL], ids=["between-cells", "mid-cell"])
def test_a_killed_kernel_leaves_its_newest_snapshot_on_disk(tmp_path, tail):
    first = Kernel(env=WITHOUT_GPUS)
    try:
        _set_up(first, tmp_path)
        log_dir, store, agent = _pool_of(first)
        at_7 = _digest_by_rank(_train_to_7_and_kill(first, tail))
    finally:
        _end_killed(first)
    second = Kernel(env=WITHOUT_GPUS)
    try:
        _set_up(second, tmp_path)  # its pool starts once the old ranks have written step 7
        wait_until_ended(agent)
        assert not os.path.exists(store), "the dead kernel's snapshots are freed"
        loaded = _ok(second, LOAD_LATEST).stdout
        assert "[all] latest 7" in loaded, loaded
        assert _digest_by_rank(_by_rank(loaded, "digest")) == at_7, (loaded, at_7)
    finally:
        second.stop()
    log = Path(log_dir, "pool.log").read_text()
    assert "its ranks write the newest snapshot in host memory (step 7 of" in log, log
    assert f"LATEST of {tmp_path / 'ckpt'} names step 7" in log, log
    assert "rank 0: the kernel is gone; wrote step 7 from host memory" in Path(log_dir, "rank-0.log").read_text()


def test_a_write_that_cannot_finish_in_time_frees_the_memory_anyway(tmp_path):
    first = Kernel(env={**WITHOUT_GPUS, "FSDP2NB_PERSIST_ON_EXIT_S": "2"})
    try:
        _set_up(first, tmp_path)
        log_dir, store, agent = _pool_of(first)
        _train_to_7_and_kill(first, RANK_1_DEAF)
        wait_until_ended(agent)
    finally:
        _end_killed(first)
    assert not os.path.exists(store)
    log = Path(log_dir, "pool.log").read_text()
    assert "for at most 2 s (FSDP2NB_PERSIST_ON_EXIT_S)" in log, log
    assert "did not finish writing the snapshot in 2 s" in log and "freed anyway" in log, log
    assert layout.read_latest(tmp_path / "ckpt") == 5, "LATEST still names the last disk save"
