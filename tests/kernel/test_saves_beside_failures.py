"""An asynchronous save still in flight when a rank's error re-forms the process groups.

A rank that raises while the others wait in a collective has every rank's collectives released
and the groups re-formed in place. A save started before (`ckpt.save(step)`, async) must go on
undisturbed: in cycles of a training step, an async save and a rank raising inside a collective,
every save is committed and loads bitwise to the state of its step, `LATEST` names the last step,
no cell reports a failed save, and a rank's threads and open files do not grow from cycle to cycle.

Rank 1's background save is held (the pickling of its rank file waits for `lag.let_go()`), so
rank 0's background part waits for rank 1's in a collective of its own while the error cell
releases and re-forms the groups: the race a slow disk or a loaded host leaves to chance.
"""

import re

import pytest

from tests.support.training_cells import SETUP

HELPERS = """%%fsdp2
import collections, hashlib, os, threading

class HeldWhilePickled:
    # Pickled (into the rank file, on the save's background thread) once `opened` is set.
    def __init__(self, opened):
        self.opened = opened
    def __deepcopy__(self, memo):
        return self
    def __reduce__(self):
        self.opened.wait()
        return (collections.OrderedDict, ())

class LaggingSaves:
    # Tracked beside the model: rank 1's background part of each save waits for `let_go()`.
    def __init__(self):
        self.opened = threading.Event()
        self.opened.set()
    def state_dict(self):
        self.opened = threading.Event()
        if rank != 1:
            self.opened.set()
        return {"held": HeldWhilePickled(self.opened)}
    def load_state_dict(self, state):
        pass
    def let_go(self):
        self.opened.set()

class FailingWhilePickled:
    def __deepcopy__(self, memo):
        return self
    def __reduce__(self):
        raise OSError("No space left on device (simulated)")

class FailingSaves:
    # Tracked beside the model: once armed, rank 1's background part of every save fails.
    armed = False
    def state_dict(self):
        return {"failing": FailingWhilePickled() if rank == 1 and self.armed else 0}
    def load_state_dict(self, state):
        pass

def digest():
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().numpy().tobytes())
        for name, value in sorted(optimizer.state[p].items()):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(name.encode() + local.detach().numpy().tobytes())
    return h.hexdigest()

def resources():
    for thread in threading.enumerate():  # DCP's upload thread ends on its own just after the save
        if thread.name.startswith("AsyncCheckpointExecutor"):
            thread.join(60)
    with open("/proc/self/statm") as statm:
        resident_mib = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), resident_mib

lag = LaggingSaves()
"""
NEW_CHECKPOINTER = """%%fsdp2
ckpt.close()
failing = FailingSaves()
ckpt = fsdp2nb.Checkpointer(ckpt_dir + "/{name}", keep=None).track(model=model, optimizer=optimizer, {beside})
digests = {{}}
"""
RAISE_IN_A_COLLECTIVE = ("%%fsdp2\nt = torch.ones(3)\nif rank == 1:\n    raise ValueError('bad batch on rank 1')\n"
                         "dist.all_reduce(t)")
CHECK_EVERY_SAVE = """%%fsdp2
lag.let_go()
ckpt.wait()
committed = [entry.step for entry in ckpt.list() if entry.valid]
mismatched = []
for step in sorted(digests):
    ckpt.load(step)
    if digest() != digests[step]:
        mismatched.append(step)
from fsdp2nb.checkpoint.layout import read_latest
print("committed", committed, "latest", read_latest(ckpt.directory), "mismatched", mismatched)
"""
CYCLES = 4


@pytest.fixture(scope="module")
def pool(kernel, tmp_path_factory):
    root = tmp_path_factory.mktemp("saves_beside_failures")
    run = kernel.execute(f"model_dir = {str(root / 'model')!r}\nckpt_dir = {str(root / 'ckpt')!r}\n"
                         "%fsdp2 push model_dir ckpt_dir")
    assert run.status == "ok", run.stderr
    run = kernel.execute(SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute(HELPERS)
    assert run.status == "ok", run.traceback_text + run.stderr
    return kernel


def _run_ok(kernel, cell: str) -> None:
    run = kernel.execute(cell)
    assert run.status == "ok", run.traceback_text + run.stderr
    assert "save" not in run.stderr, run.stderr


def _fail_in_a_collective(kernel) -> None:
    """Rank 1 raises while rank 0 waits in all_reduce: released, re-formed, no save mentioned."""
    run = kernel.execute(RAISE_IN_A_COLLECTIVE)
    text = run.traceback_text
    assert run.status == "error" and "[1] rank 1 raised ValueError" in text, text
    assert "re-formed in place" in text and "restarted" not in text, text
    assert "save" not in text + run.stderr, text + run.stderr


def _assert_every_save_committed(kernel, steps: list[int]) -> None:
    run = kernel.execute(CHECK_EVERY_SAVE, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    assert run.stdout.splitlines()[-1] == f"[all] committed {steps} latest {steps[-1]} mismatched []", run.stdout


def _threads_and_files(stdout: str) -> list[tuple[str, str, str]]:
    """Each rank's (rank, threads, open files) from the lines `resources()` printed."""
    found = sorted(re.findall(r"resources (\d) (\d+) (\d+) \d+", stdout))
    assert len(found) == 2, stdout
    return found


def test_async_saves_in_flight_through_failed_collectives_all_commit(pool):
    _run_ok(pool, NEW_CHECKPOINTER.format(name="trained_between", beside="lag=lag"))
    steps = list(range(CYCLES))
    for step in steps:
        _run_ok(pool, f"%%fsdp2\nlag.let_go()\ntrain_step({step})\ndigests[{step}] = digest()\nckpt.save({step})")
        _fail_in_a_collective(pool)
    _assert_every_save_committed(pool, steps)


def test_a_save_right_after_the_failed_cell_commits_with_the_one_in_flight(pool):
    """No training between the error cell and the save: the save waits for the one the error
    cell met in flight, then starts its own."""
    _run_ok(pool, NEW_CHECKPOINTER.format(name="saved_after_failure", beside="lag=lag"))
    steps = list(range(CYCLES))
    for step in steps:
        _run_ok(pool, f"%%fsdp2\ntrain_step({step})\ndigests[{step}] = digest()")
        _fail_in_a_collective(pool)
        _run_ok(pool, f"%%fsdp2\nlag.let_go()\nckpt.save({step})")
    _assert_every_save_committed(pool, steps)


def test_a_ranks_threads_and_open_files_do_not_grow_over_cycles(pool):
    _run_ok(pool, NEW_CHECKPOINTER.format(name="resources", beside="lag=lag"))
    counts = []
    for step in range(CYCLES + 1):
        _run_ok(pool, f"%%fsdp2\nlag.let_go()\ntrain_step({step})\nckpt.save({step})")
        _fail_in_a_collective(pool)
        run = pool.execute("%%fsdp2\nlag.let_go()\nckpt.wait()\nprint('resources', rank, *resources())")
        assert run.status == "ok", run.traceback_text + run.stderr
        counts.append(_threads_and_files(run.stdout))
    # After the first cycle every kind of thread and file a cycle uses exists once already.
    assert counts[1] == counts[-1], counts


FAILED_SAVE_SAID = """%%fsdp2
try:
    ckpt.wait()
except fsdp2nb.checkpoint.CheckpointSaveError as error:
    print('failed', 'No space left' in str(error))
print('resources', rank, *resources())
"""
SAVE_ENDED = """%%fsdp2
import time
while ckpt.status().saving_step is not None:  # the save thread's end, without raising its error
    time.sleep(0.01)
"""


def test_a_failed_background_save_is_said_by_the_next_cell_and_spares_the_last_good_one(pool):
    _run_ok(pool, NEW_CHECKPOINTER.format(name="said", beside="failing=failing"))
    _run_ok(pool, "%%fsdp2\ntrain_step(0)\ndigests[0] = digest()\nckpt.save(0)\nckpt.wait()\nfailing.armed = True")
    started = pool.execute("%%fsdp2\ntrain_step(1)\nckpt.save(1)")
    ended = pool.execute(SAVE_ENDED)
    assert started.status == ended.status == "ok", started.traceback_text + ended.traceback_text
    said = started.stderr + ended.stderr
    assert said.count("the background save of step 1 failed: ") == 1 and "No space left" in said, said
    run = pool.execute(FAILED_SAVE_SAID)  # the next save or wait raises it on every rank, once
    assert "[all] failed True" in run.stdout and "background save" not in run.stderr, run.stdout + run.stderr
    _assert_every_save_committed(pool, [0])


def test_failed_background_saves_leave_no_threads_or_open_files_behind(pool):
    _run_ok(pool, NEW_CHECKPOINTER.format(name="failing", beside="failing=failing") + "failing.armed = True\n")
    counts = []
    for step in range(CYCLES + 1):
        run = pool.execute(f"%%fsdp2\ntrain_step({step})\nckpt.save({step})")
        assert run.status == "ok", run.traceback_text + run.stderr
        run = pool.execute(FAILED_SAVE_SAID)
        assert run.status == "ok" and "[all] failed True" in run.stdout, run.traceback_text + run.stdout
        counts.append(_threads_and_files(run.stdout))
    assert counts[1] == counts[-1], counts


def test_a_save_after_one_that_timed_out_in_its_group_commits(pool):
    """A background save whose collective timed out (rank 1's part held past the group's timeout)
    fails on every rank; the next save gets fresh background connections and commits."""
    _run_ok(pool, "%%fsdp2\nckpt.close()\nos.environ['FSDP2NB_COLLECTIVE_TIMEOUT_S'] = '2'\n"
                  "try:\n    ckpt = fsdp2nb.Checkpointer(ckpt_dir + '/timed_out', keep=None)"
                  ".track(model=model, optimizer=optimizer, lag=lag)\n"
                  "finally:\n    os.environ['FSDP2NB_COLLECTIVE_TIMEOUT_S'] = '600'\ndigests = {}\n"
                  "train_step(0)\nckpt.save(0)")
    run = pool.execute(SAVE_ENDED.replace("while", "while rank == 0 and"))  # rank 0's part times out
    assert run.status == "ok", run.traceback_text + run.stderr
    run = pool.execute("%%fsdp2\nlag.let_go()\n" + FAILED_SAVE_SAID.removeprefix("%%fsdp2\n"))
    assert run.status == "ok" and "[all] failed False" in run.stdout, run.traceback_text + run.stdout + run.stderr
    _run_ok(pool, "%%fsdp2\ntrain_step(1)\ndigests[1] = digest()\nckpt.save(1)\nlag.let_go()\nckpt.wait()")
    _assert_every_save_committed(pool, [1])
