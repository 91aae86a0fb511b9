"""A dying rank costs a step, not the session: snapshots in host memory (`memory_every=1`) through a
real kernel. A rank killed after step 5, the host agent killed, a kept pool reattached from a new
kernel: each time the set-up cell run again restores step 5 bitwise, and training on gives the
losses of a run without the fault. `%fsdp2 stop` frees the memory."""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path

import psutil
import pytest

from tests.support import training_cells
from tests.support.host_processes import wait_until_ended
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

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
assert "memory_every=1" in SETUP, "the set-up cell of the training tests makes its Checkpointer so"

TRAIN_TO_5 = """%%fsdp2
for step in range(6):
    train_step(step)
    ckpt.maybe_save(step)
ckpt.wait()
print("digest", digest())
"""

TRAIN_ON = """%%fsdp2
start = 0 if ckpt.last_step is None else ckpt.last_step + 1
print("digest", digest())
print("start", start)
print("losses", " ".join(f"{train_step(step):.6f}" for step in range(start, 9)))
"""

SELF_KILL_AT_6 = """%%fsdp2
import signal
for step in range(6, 9):
    if step == 6 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    train_step(step)
"""


def _defines(tmp_path: Path) -> str:
    return f"%%fsdp2\nmodel_dir = {str(tmp_path / 'model')!r}\nckpt_dir = {str(tmp_path / 'ckpt')!r}\n"


def _ok(kernel: Kernel, code: str, timeout: float = 300):
    run = kernel.execute(code, timeout=timeout)
    assert run.status == "ok", run.traceback_text or run.stderr
    return run


def _by_rank(text: str, word: str) -> dict[str, str]:
    return dict(re.findall(rf"\[(\d)\] {word} (\S+)", text))


def _train_and_remember(kernel: Kernel, tmp_path: Path) -> tuple[dict, str]:
    """Steps 0-5 with a snapshot each; the state's digest at 5 and the losses of 6-8 after it,
    run without snapshots (step 5 stays the newest in memory)."""
    _ok(kernel, _defines(tmp_path))
    _ok(kernel, SETUP)
    at_5 = _by_rank(_ok(kernel, TRAIN_TO_5).stdout, "digest")
    unfaulted = _ok(kernel, TRAIN_ON).stdout
    return at_5, unfaulted


def _restores_step_5(kernel: Kernel, at_5: dict, unfaulted: str) -> None:
    setup = _ok(kernel, SETUP)
    assert "[0] restored step 5 from memory in" in setup.stdout, setup.stdout
    assert "the disk has no checkpoint" in setup.stdout, setup.stdout
    resumed = _ok(kernel, TRAIN_ON).stdout
    assert "[all] start 6" in resumed, resumed
    assert _by_rank(resumed, "digest") == at_5
    assert re.findall(r"losses (.*)", resumed) == re.findall(r"losses (.*)", unfaulted), (resumed, unfaulted)


def _store_files(kernel: Kernel) -> list[str]:
    run = _ok(kernel, "import fsdp2nb\nprint(fsdp2nb._session.memory_dir or fsdp2nb._session.pool.memory_dir)")
    store = run.stdout.strip()
    return [store] if os.path.isdir(store) else []


@pytest.fixture()
def kernel():
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    _ok(k, "%fsdp2 start --cpu 2 --no-dashboard")
    yield k
    k.stop()


def test_a_rank_killed_after_step_5_is_restored_from_memory(kernel, tmp_path):
    at_5, unfaulted = _train_and_remember(kernel, tmp_path)
    run = kernel.execute(SELF_KILL_AT_6, timeout=300)
    text = run.traceback_text
    assert run.status == "error" and "rank 1" in text and "killed by SIGKILL" in text, text
    assert "the pool was restarted" in text and "step 5 of" in text and "is kept in memory" in text, text
    status = _ok(kernel, "%fsdp2 status").stdout
    assert re.search(r"in memory: step 5 of .*ckpt \(.*of host memory\), held by 2 of 2 ranks", status), status
    _ok(kernel, _defines(tmp_path))
    _restores_step_5(kernel, at_5, unfaulted)
    by_hand = _ok(kernel, "%fsdp2 load memory").stdout
    assert "[0] restored step" in by_hand, by_hand


def test_the_host_agent_killed_leaves_the_snapshot_to_restore(kernel, tmp_path):
    at_5, unfaulted = _train_and_remember(kernel, tmp_path)
    agent = int(_ok(kernel, "%%fsdp2 --ranks 0\nprint(os.getppid())").stdout.split()[-1])
    os.kill(agent, signal.SIGKILL)
    wait_until_ended(agent)
    run = kernel.execute(_defines(tmp_path), timeout=300)  # the next cell restarts the pool and says so
    assert "killed by SIGKILL" in run.stderr and "step 5 of" in run.stderr, run.stderr
    _restores_step_5(kernel, at_5, unfaulted)


def test_stop_frees_the_snapshot_and_a_refused_one_changes_nothing(kernel, tmp_path):
    _ok(kernel, _defines(tmp_path))
    _ok(kernel, SETUP)
    _ok(kernel, TRAIN_TO_5)
    stores = _store_files(kernel)
    assert stores and any(Path(stores[0]).rglob("rank-00000.slot0"))
    other = _ok(kernel, "%%fsdp2\ntry:\n    fsdp2nb.Checkpointer(ckpt_dir + '-x', memory_every=0)\n"
                        "except ValueError as e:\n    print('refused:', e)")
    assert "refused: memory_every=0 is not allowed" in other.stdout, other.stdout
    _ok(kernel, "%fsdp2 stop")
    assert not os.path.exists(stores[0])
    leftover = [p for p in Path("/dev/shm").glob(f"fsdp2nb-snapshots-{os.getuid()}/session-{kernel.pid}-*")]
    assert not leftover


def test_a_kept_pool_reattached_from_a_new_kernel_restores(tmp_path):
    name = f"mem-{uuid.uuid4().hex[:6]}"
    first = Kernel(env=WITHOUT_GPUS)
    try:
        assert first.execute("%load_ext fsdp2nb").status == "ok"
        _ok(first, f"%fsdp2 start --cpu 2 --keep --name {name} --no-dashboard")
        at_5, unfaulted = _train_and_remember(first, tmp_path)
        rank_1 = int(_ok(first, "%%fsdp2 --ranks 1\nprint(os.getpid())").stdout.split()[-1])
        _ok(first, "%fsdp2 detach")
    finally:
        first.stop()
    os.kill(rank_1, signal.SIGKILL)  # while no kernel holds the pool
    second = Kernel(env=WITHOUT_GPUS)
    try:
        assert second.execute("%load_ext fsdp2nb").status == "ok"
        attach = second.execute(f"%fsdp2 attach {name}", timeout=120)
        assert "rank 1" in attach.stdout + attach.stderr + attach.traceback_text
        restart = _ok(second, "%fsdp2 restart")
        assert "step 5 of" in restart.stdout and "kept in memory" in restart.stdout, restart.stdout
        _ok(second, _defines(tmp_path))
        _restores_step_5(second, at_5, unfaulted)
        _ok(second, "%fsdp2 stop")
        assert not (Path("/dev/shm") / f"fsdp2nb-snapshots-{os.getuid()}" / f"kept-{name}").exists()
    finally:
        second.stop()


def test_a_killed_kernel_leaves_no_snapshot_behind(tmp_path):
    """The host agent frees the store when its kernel is gone: no process and no /dev/shm files stay."""
    k = Kernel(env=WITHOUT_GPUS)
    try:
        assert k.execute("%load_ext fsdp2nb").status == "ok"
        _ok(k, "%fsdp2 start --cpu 2 --no-dashboard")
        _ok(k, _defines(tmp_path))
        _ok(k, SETUP)
        _ok(k, TRAIN_TO_5)
        store = _store_files(k)[0]
        agent = int(_ok(k, "%%fsdp2 --ranks 0\nprint(os.getppid())").stdout.split()[-1])
        pool_processes = [psutil.Process(agent), *psutil.Process(agent).children()]
        os.kill(k.pid, signal.SIGKILL)
        for process in pool_processes:
            wait_until_ended(process.pid)
        assert not os.path.exists(store)
    finally:
        k.stop()


def test_a_kept_pool_that_expires_frees_its_snapshot(tmp_path):
    name = f"exp-{uuid.uuid4().hex[:6]}"
    k = Kernel(env=WITHOUT_GPUS)
    try:
        assert k.execute("%load_ext fsdp2nb").status == "ok"
        _ok(k, f"%fsdp2 start --cpu 2 --keep --name {name} --keep-for 3s --no-dashboard")
        _ok(k, _defines(tmp_path))
        _ok(k, SETUP)
        _ok(k, TRAIN_TO_5)
        store = Path("/dev/shm") / f"fsdp2nb-snapshots-{os.getuid()}" / f"kept-{name}"
        assert any(store.rglob("rank-00001.json"))
        agent = psutil.Process(int(_ok(k, "%%fsdp2 --ranks 0\nprint(os.getppid())").stdout.split()[-1]))
        _ok(k, "%fsdp2 detach")
    finally:
        k.stop()
    wait_until_ended(agent.pid)  # unheld and idle for 3 s: it ends
    assert not store.exists()


REWOUND_BY_A_DISK_LOAD = """%%fsdp2
for step in range(6):
    train_step(step)
    if step == 2:
        ckpt.save(step)
    ckpt.maybe_save(step)
ckpt.wait()
ckpt.load(2)
train_step(3)
ckpt.maybe_save(3)
ckpt.wait()
print("digest", digest())
train_step(4)
"""

REWOUND_BY_A_LOOP_FROM_0 = """%%fsdp2
for step in range(6):
    train_step(step)
    ckpt.maybe_save(step)
for step in range(2):
    train_step(step)
    ckpt.maybe_save(step)
ckpt.wait()
print("digest", digest())
train_step(2)
"""


def _memory_restores_the_new_run(kernel: Kernel, tmp_path: Path, rewound: str, step: int) -> None:
    """After the rewind, `load memory` restores the new run's `step` (the live state had moved
    on past it), never the abandoned run's step 5."""
    _ok(kernel, _defines(tmp_path))
    _ok(kernel, SETUP)
    at_step = _by_rank(_ok(kernel, rewound).stdout, "digest")
    loaded = _ok(kernel, "%fsdp2 load memory").stdout
    assert f"[0] restored step {step} from memory" in loaded, loaded
    assert _by_rank(_ok(kernel, '%%fsdp2\nprint("digest", digest())').stdout, "digest") == at_step


def test_after_a_disk_load_of_an_older_step_memory_restores_the_new_run(kernel, tmp_path):
    _memory_restores_the_new_run(kernel, tmp_path, REWOUND_BY_A_DISK_LOAD, 3)


def test_after_a_loop_started_again_from_0_memory_restores_the_new_run(kernel, tmp_path):
    _memory_restores_the_new_run(kernel, tmp_path, REWOUND_BY_A_LOOP_FROM_0, 1)
