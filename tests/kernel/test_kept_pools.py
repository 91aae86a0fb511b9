"""Kept pools through real kernels: ranks and their names outlive the kernel that started them.

Every test gives its kernels a TMPDIR of its own, so that the kept pools (under the user's state
directory there) of one test, or of another checkout's tests, are never seen by another.
"""

import glob
import os
import re
import shutil
import signal
import stat
import tempfile
import time

import psutil
import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel, kernels_with_fsdp2nb

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def tmpdir_env():
    root = tempfile.mkdtemp(prefix="kp-")  # short: the kernel's Unix socket lives under it
    yield {**WITHOUT_GPUS, "TMPDIR": root}
    for path in _kept_dirs(root):  # end what a failed test left running
        _kill_agent(path)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kernels(tmpdir_env):
    """Starts kernels with the extension loaded; stops (or kills) them at the end."""
    with kernels_with_fsdp2nb(tmpdir_env) as start:
        yield start


def _kept_dirs(root: str) -> list[str]:
    base = os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept")
    return [os.path.join(base, name) for name in os.listdir(base)] if os.path.isdir(base) else []


def _agent_pid(root: str, name: str) -> int:
    import json

    with open(os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept", name, "pool.json")) as meta:
        return json.load(meta)["agent"][0]


def _kill_agent(path: str) -> None:
    import json

    try:
        with open(os.path.join(path, "pool.json")) as meta:
            pid = json.load(meta)["agent"][0]
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


def _usage_lines(run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("UsageError")]


def _sigkill(kernel: Kernel) -> None:
    os.kill(kernel.pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(kernel.pid)], timeout=10) if psutil.pid_exists(kernel.pid) else None


def _until_detached(root: str, name: str, timeout_s: float = 30) -> None:
    """Until the agent has noted that no kernel holds the pool: it rewrites the attach record
    when the holder's pidfd says the kernel is gone."""
    from fsdp2nb.pool.kept.directory import read_attach_record
    from fsdp2nb.wire.signing import Signer

    directory = os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept", name)
    with open(os.path.join(directory, "key")) as key_file:
        signer = Signer(bytes.fromhex(key_file.read()))
    deadline = time.monotonic() + timeout_s
    while (record := read_attach_record(directory, signer)) is None or record.holder_pid:
        assert time.monotonic() < deadline, f"the agent did not note the kernel's end within {timeout_s} s"
        time.sleep(0.05)


def _gone(pid: int, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_names_on_ranks_survive_a_killed_kernel(kernels, tmpdir_env):
    a = kernels()
    run = a.execute("%fsdp2 start --cpu 2 --keep --name lab --no-dashboard")
    assert run.status == "ok", run.stderr
    assert "kept as 'lab'" in run.stdout
    assert a.execute("%%fsdp2\nx = 10 + rank").status == "ok"
    root = tmpdir_env["TMPDIR"]
    agent = _agent_pid(root, "lab")
    kept = os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept", "lab")
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(kept, "key")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(kept)).st_mode) == 0o700
    _sigkill(a)
    _until_detached(root, "lab")
    assert psutil.pid_exists(agent) and psutil.Process(agent).status() != psutil.STATUS_ZOMBIE

    b = kernels()
    listing = b.execute("%fsdp2 pools")
    assert listing.status == "ok", listing.stderr
    assert listing.result_text.startswith("lab: --cpu 2, detached (since "), listing.result_text
    data = b.execute("pools = %fsdp2 pools\nprint(len(pools), pools[0].name, pools[0].holder_pid)")
    assert data.stdout == "1 lab None\n", data.stderr
    run = b.execute("%fsdp2 attach --no-dashboard")  # the only kept pool: no name needed
    assert run.status == "ok", run.stderr + run.traceback_text
    assert "attached kept pool 'lab'" in run.stdout
    run = b.execute("%%fsdp2\nprint(x)")
    assert run.stdout == "[0] 10\n[1] 11\n", run.stderr + run.traceback_text
    assert f"held by kernel {b.pid}" in b.execute("%fsdp2 pools").result_text

    assert b.execute("%fsdp2 stop").stdout == "pool stopped\n"
    assert _gone(agent)
    assert not os.path.exists(kept)
    assert b.execute("%fsdp2 pools").result_text == "no kept pools"


def test_detach_attach_take_and_the_old_holder(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%%fsdp2 --cpu 2 --keep --name shared --no-dashboard\ny = rank * 2").status == "ok"
    run = a.execute("%fsdp2 detach")
    assert run.status == "ok" and "detached" in run.stdout, run.stderr
    assert a.execute("%fsdp2 pools").result_text.startswith("shared: --cpu 2, detached")

    b = kernels()
    assert b.execute("%fsdp2 attach shared --no-dashboard").status == "ok"
    run = a.execute("%fsdp2 attach shared --no-dashboard")  # the second attach: refused, names the holder
    lines = _usage_lines(run)
    assert len(lines) == 1 and f"held by kernel {b.pid}" in lines[0] and "--take" in lines[0], run.stderr
    assert b.execute("%%fsdp2\nprint(y)").stdout == "[0] 0\n[1] 2\n"

    run = a.execute("%fsdp2 attach shared --take --no-dashboard")
    assert run.status == "ok", run.stderr
    assert a.execute("%%fsdp2\nprint(y)").stdout == "[0] 0\n[1] 2\n"
    run = b.execute("%%fsdp2\nprint(y)")  # the old holder: one line, no traceback of internals
    lines = _usage_lines(run)
    assert run.status == "error" and len(lines) == 1 and "was taken by" in lines[0], run.stderr
    assert "Traceback" not in run.stderr
    assert a.execute("%%fsdp2\nprint(y + 1)").stdout == "[0] 1\n[1] 3\n"  # the new holder is untouched
    assert a.execute("%fsdp2 stop").status == "ok"


def test_a_pool_of_another_wire_version_is_refused_in_one_line_and_left_alone(kernels, tmpdir_env):
    """A kept pool whose attach record was written by an fsdp2nb from before wire protocol
    versions (forged here as that release wrote it: AttachRecord by its place, 23, in the tuple of
    types) is refused by a kernel that attaches, which writes nothing there."""
    import pickle

    from fsdp2nb.pool.kept.directory import read_attach_record
    from fsdp2nb.wire.protocol import PROTOCOL_VERSION
    from fsdp2nb.wire.signing import Signer

    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name older --no-dashboard").status == "ok"
    assert a.execute("%%fsdp2\nz = rank + 5").status == "ok"
    assert a.execute("%fsdp2 detach").status == "ok"
    root = tmpdir_env["TMPDIR"]
    directory = os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept", "older")
    with open(os.path.join(directory, "key")) as key_file:
        signer = Signer(bytes.fromhex(key_file.read()))
    record_path = os.path.join(directory, "attach")
    with open(record_path, "rb") as record_file:
        genuine = record_file.read()
    record = read_attach_record(directory, signer)
    payload = pickle.dumps((23, tuple(vars(record).values())))
    forged = signer._sign(payload) + payload
    with open(record_path, "wb") as record_file:
        record_file.write(forged)

    b = kernels()
    run = b.execute("%fsdp2 attach older --no-dashboard")
    lines = _usage_lines(run)
    assert run.status == "error" and len(lines) == 1, run.stderr
    assert ("kept pool 'older' speaks wire protocol 0 (an fsdp2nb from before protocol versions), "
            f"this kernel speaks wire protocol {PROTOCOL_VERSION}") in lines[0], lines[0]
    assert f"`kill {_agent_pid(root, 'older')}` (its host agent; rank state is lost)" in lines[0]
    assert "Traceback" not in run.stderr
    with open(record_path, "rb") as record_file:
        assert record_file.read() == forged  # nothing written: the pool is as its own release left it
    listing = b.execute("%fsdp2 pools").result_text
    assert listing.startswith("older: --cpu 2, speaks wire protocol 0"), listing

    with open(record_path, "wb") as record_file:  # its own version's record again: it attaches, state kept
        record_file.write(genuine)
    run = b.execute("%fsdp2 attach older --no-dashboard")
    assert run.status == "ok", run.stderr + run.traceback_text
    assert b.execute("%%fsdp2\nprint(z)").stdout == "[0] 5\n[1] 6\n"
    assert b.execute("%fsdp2 stop").status == "ok"


def test_restart_keeps_a_kept_pool_kept_and_keep_for_ends_it_once_unheld_and_idle(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name brief --keep-for 3s --no-dashboard").status == "ok"
    first = _agent_pid(tmpdir_env["TMPDIR"], "brief")
    run = a.execute("%fsdp2 restart")
    assert run.status == "ok", run.stderr
    agent = _agent_pid(tmpdir_env["TMPDIR"], "brief")
    assert agent != first and _gone(first)
    listing = a.execute("%fsdp2 pools").result_text
    assert listing.startswith("brief: --cpu 2, held by kernel"), listing
    assert "ends in" not in listing  # held: the clock does not run
    assert a.execute("%fsdp2 detach").status == "ok"
    assert "ends in" in a.execute("%fsdp2 pools").result_text
    assert _gone(agent, timeout_s=30)
    assert a.execute("%fsdp2 pools").result_text == "no kept pools"


BAD_INPUTS = [
    ("%fsdp2 attach nosuch", "no kept pool is named 'nosuch'"),
    ("%fsdp2 start --cpu 2 --keep --keep-for '5 parsecs'", "is not a duration"),
    ("%fsdp2 start --cpu 2 --keep-for 5m", "add --keep"),
    ("%fsdp2 start --cpu 2 --keep --name ../x", "is not a pool name"),
    ("%fsdp2 detach", "nothing to detach"),
    ("%fsdp2 attach", "no kept pool exists"),
]


def test_bad_input_gets_one_line_and_changes_nothing(kernels, tmpdir_env):
    a = kernels()
    for code, message in BAD_INPUTS:
        run = a.execute(code)
        lines = _usage_lines(run)
        assert run.status == "error" and len(lines) == 1 and message in lines[0], (code, run.stderr)
        assert a.execute("%fsdp2 status").stdout.strip() == "no pool is running"
    assert a.execute("%fsdp2 start --cpu 1 --keep --name twice --no-dashboard").status == "ok"
    b = kernels()
    run = b.execute("%fsdp2 start --cpu 1 --keep --name twice --no-dashboard")
    lines = _usage_lines(run)
    assert len(lines) == 1 and "exists already" in lines[0], run.stderr
    assert b.execute("%fsdp2 status").stdout.strip() == "no pool is running"
    assert a.execute("%%fsdp2\nprint('still here')").stdout == "still here\n"  # one rank: no label
    # a pool whose agent died: refused in one line, and its directory is cleaned up
    agent = _agent_pid(tmpdir_env["TMPDIR"], "twice")
    assert a.execute("%fsdp2 detach").status == "ok"
    os.kill(agent, signal.SIGKILL)
    assert _gone(agent)
    run = b.execute("%fsdp2 attach twice")
    lines = _usage_lines(run)
    assert len(lines) == 1 and "its host agent" in lines[0] and "ended" in lines[0], run.stderr
    assert b.execute("%fsdp2 pools").result_text == "no kept pools"
    run = b.execute("%%fsdp2 --cpu 2 --slurm --keep\n1")
    assert len(_usage_lines(run)) == 1, run.stderr


def test_a_background_run_goes_on_while_detached(kernels, tmpdir_env, tmp_path):
    flag = tmp_path / "go-on"
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name bg --no-dashboard").status == "ok"
    code = ("%%fsdp2 --bg --name train\nimport itertools, os, time\nfor step in itertools.count():\n"
            f"    print('step', step, flush=True)\n    if os.path.exists({str(flag)!r}):\n        break\n"
            "    time.sleep(0.2)\ndone = True")
    assert a.execute(code).status == "ok"
    log = _until_rank_log_says(tmpdir_env, "step 2\n")
    _sigkill(a)
    after_kill = f"step {_num_lines(log, 'step ') + 2}\n"
    _until_rank_log_says(tmpdir_env, after_kill)  # printed while no kernel held the pool: in the rank's log

    b = kernels()
    assert "In[" in b.execute("%fsdp2 pools").result_text  # the run shows while detached
    attach = b.execute("%fsdp2 attach bg --no-dashboard")
    assert attach.status == "ok", attach.stderr
    assert "last lines of rank 0's log" in attach.stdout and "  step " in attach.stdout, attach.stdout
    assert "is still running" in attach.stdout, attach.stdout
    flag.touch()
    run = b.execute("%fsdp2 wait")
    assert run.status == "ok", run.stderr
    # Its output streamed under the attach cell: the wait says, in one line, how and where it ended.
    logs = glob.glob(os.path.join(tmpdir_env["TMPDIR"], f"fsdp2nb-{os.getuid()}", "logs", "*", "rank-0.log"))
    (line,) = run.stdout.splitlines()
    attach_cell = attach.reply["content"]["execution_count"]
    assert re.fullmatch(rf"In\[3\] of kernel {a.pid} \(train\) on ranks 0-1: done after \d+:\d\d; its output is "
                        rf"under In\[{attach_cell}\], the attach cell, and in the rank logs in "
                        rf"{re.escape(os.path.dirname(logs[0]))}", line), line
    assert b.execute("%%fsdp2\nprint(done)").stdout == "[all] True\n"
    assert b.execute("%fsdp2 stop").status == "ok"


def _until_rank_log_says(tmpdir_env: dict, text: str, timeout_s: float = 60) -> str:
    """The path of rank 0's log (the only pool under this TMPDIR), once it contains `text`."""
    pattern = os.path.join(tmpdir_env["TMPDIR"], f"fsdp2nb-{os.getuid()}", "logs", "*", "rank-0.log")
    deadline = time.monotonic() + timeout_s
    while True:
        for path in glob.glob(pattern):
            with open(path) as log:
                if text in log.read():
                    return path
        assert time.monotonic() < deadline, f"rank 0's log did not say {text!r} within {timeout_s} s"
        time.sleep(0.05)


def _num_lines(path: str, prefix: str) -> int:
    with open(path) as log:
        return sum(line.startswith(prefix) for line in log)


def test_interrupt_acts_on_a_run_of_the_lost_kernel(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name stuck --no-dashboard").status == "ok"
    assert a.execute("%%fsdp2 --bg\nimport time\ntime.sleep(600)").status == "ok"
    assert "running on ranks 0-1" in _pools_until(a, "running on ranks 0-1")  # the run reached the ranks
    _sigkill(a)
    b = kernels()
    assert "still running" in b.execute("%fsdp2 attach stuck --no-dashboard").stdout
    run = b.execute("%fsdp2 interrupt")
    assert run.status == "ok" and "interrupt sent" in run.stdout, run.stderr
    b.execute("%fsdp2 wait", timeout=60)
    assert b.execute("%%fsdp2\nprint('free')").stdout == "[all] free\n"
    assert b.execute("%fsdp2 stop").status == "ok"


def test_a_kernel_shut_down_lets_go_of_its_kept_pool(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%%fsdp2 --cpu 2 --keep --name calm\nz = 'kept'").status == "ok"
    agent = _agent_pid(tmpdir_env["TMPDIR"], "calm")
    a.stop()  # a shutdown runs the extension's exit hook: it lets go, it does not end the pool
    b = kernels()
    assert b.execute("%fsdp2 pools").result_text.startswith("calm: --cpu 2, detached")
    run = b.execute("%fsdp2 attach calm")  # with the dashboard this time
    assert run.status == "ok", run.stderr + run.traceback_text
    assert b.execute("%%fsdp2\nprint(z)").stdout == "[all] kept\n"
    assert b.execute("%fsdp2 stop").status == "ok"
    assert _gone(agent)


SAVE_SETUP = """%%fsdp2 --cpu 2 --keep --name saves --no-dashboard
import fsdp2nb
from torch.distributed.fsdp import fully_shard
model = torch.nn.Linear(8, 4)
fully_shard(model, mesh=mesh)
ckpt = fsdp2nb.Checkpointer(CKPT, async_save=False).track(model=model)
"""
SAVE_AT = """%%fsdp2
import time
from fsdp2nb.checkpoint.requests import process_requests
while not process_requests().pending():  # the request came on the control connection: until it is here
    time.sleep(0.05)
print(ckpt.maybe_save({step}))
"""


def test_a_save_asked_after_attach_is_served(kernels, tmpdir_env, tmp_path):
    """The dashboard's Save (pool.request_save) of a kernel that attached is served by the ranks'
    next maybe_save, even after an earlier holder's Save was: its request ids count on from there."""
    a = kernels()
    run = a.execute(SAVE_SETUP.replace("--no-dashboard\n", f"--no-dashboard\nCKPT = {str(tmp_path / 'ckpt')!r}\n"))
    assert run.status == "ok", run.stderr + run.traceback_text
    assert a.execute("import fsdp2nb\nfsdp2nb._session.pool.request_save()").status == "ok"
    run = a.execute(SAVE_AT.format(step=1))
    assert run.stdout == "[all] True\n", run.stderr + run.traceback_text
    assert a.execute("%fsdp2 detach").status == "ok"

    b = kernels()
    assert b.execute("%fsdp2 attach saves --no-dashboard").status == "ok"
    run = b.execute("import fsdp2nb\nfsdp2nb._session.pool.request_save()")
    assert run.status == "ok", run.traceback_text
    run = b.execute(SAVE_AT.format(step=2))
    assert run.stdout == "[all] True\n", run.stderr + run.traceback_text  # not taken for the first save
    assert (tmp_path / "ckpt" / "step-000002").is_dir()
    assert b.execute("%fsdp2 stop").status == "ok"


def test_a_run_of_the_old_holder_ends_when_the_pool_is_taken(kernels, tmpdir_env, tmp_path):
    """`attach --take` from another kernel while this one's --bg run goes: the run's handle here
    ends (failed, one line saying the pool was taken), so `%fsdp2 wait` returns; the run itself
    goes on in the kernel that took the pool, which can wait for it."""
    flag = tmp_path / "flag"
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name handover --no-dashboard").status == "ok"
    run = a.execute(f"%%fsdp2 --bg --name train\nimport os, time\nwhile not os.path.exists({str(flag)!r}):\n"
                    "    time.sleep(0.05)\nfinished = 'yes'")
    assert run.status == "ok", run.stderr
    b = kernels()
    run = b.execute("%fsdp2 attach handover --take --no-dashboard")
    assert run.status == "ok" and "is still running" in run.stdout, run.stderr + run.stdout

    run = a.execute("%fsdp2 wait", timeout=60)
    lines = run.traceback_text.splitlines()
    assert run.status == "error" and len(lines) == 1, run.traceback_text + run.stderr
    assert f"kept pool 'handover' was taken by kernel {b.pid}" in lines[0], lines
    assert "Traceback" not in run.stderr
    assert a.execute("print(train.state)").stdout == "failed\n"
    run = a.execute("%%fsdp2\nprint('mine?')")  # the next cell: the pool is gone from this kernel, as before
    assert run.status == "error" and "was taken by" in run.stderr, run.stderr

    flag.touch()
    assert b.execute("%fsdp2 wait", timeout=60).status == "ok"  # the run ended well where it went on
    assert b.execute("%%fsdp2\nprint(finished)").stdout == "[all] yes\n"
    assert b.execute("%fsdp2 stop").status == "ok"


def _pools_until(kernel: Kernel, text: str, timeout_s: float = 60) -> str:
    """`%fsdp2 pools` again until its line says `text` (the ranks got there meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while True:
        listing = kernel.execute("%fsdp2 pools").result_text
        if text in listing or time.monotonic() > deadline:
            return listing
        time.sleep(0.2)


def _wait_for(flag: str) -> str:
    return f"import os, time\nwhile not os.path.exists({flag!r}):\n    time.sleep(0.05)\n"


SECOND_REQUEST = """import fsdp2nb
from fsdp2nb.wire.requests import RunCell
session = fsdp2nb._session
second = session.requests.request_wait(session.pool, (1,))
second.send(RunCell(cell_id=second.cell_id, code={code!r}, transformed={code!r}, execution_count=99))
"""


def test_the_reattached_run_is_named_covers_every_request_and_keeps_finished_results(kernels, tmpdir_env, tmp_path):
    """A kernel dies while rank 0 runs its `--bg --name train` run and rank 1 another request;
    rank 0 finishes while no kernel holds the pool. The kernel that attaches gets one handle,
    named as the lost kernel named it, that waits for both requests, shows rank 0's result, and
    whose clocks (the handle's, the dashboard's) count from the run's start, not the attach."""
    early, late = str(tmp_path / "early"), str(tmp_path / "late")
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name names --no-dashboard").status == "ok"
    run = a.execute(f"%%fsdp2 --bg --ranks 0 --name train\n{_wait_for(early)}'early result'")
    assert run.status == "ok", run.stderr
    second = _wait_for(late) + "'late result'"
    assert a.execute(SECOND_REQUEST.format(code=second)).status == "ok"
    started = time.monotonic()
    assert "running on ranks 0-1" in _pools_until(a, "running on ranks 0-1")
    time.sleep(max(0.0, 3 - (time.monotonic() - started)))  # the run is at least 3 s old at the attach
    _sigkill(a)
    open(early, "w").close()  # rank 0 finishes while no kernel holds the pool

    b = kernels()
    assert "In[99] running on rank 1 for" in _pools_until(b, "running on rank 1 ")
    attach = b.execute("%fsdp2 attach names --no-dashboard")
    assert attach.status == "ok", attach.stderr + attach.traceback_text
    assert f"In[3] of kernel {a.pid} (train) is still running on rank 1;" in attach.stdout, attach.stdout
    run = b.execute("print(train.ranks, train.state, train.elapsed_s >= 3)")
    assert run.stdout == "(0, 1) running True\n", run.stderr + run.traceback_text
    dashboard = b.execute("import fsdp2nb\nprint(fsdp2nb._session.dashboard_link().text())").stdout
    busy = re.search(r"^1 +busy (\d+) (s|min)", dashboard, re.MULTILINE)
    assert busy and (busy.group(2) == "min" or int(busy.group(1)) >= 3), dashboard
    assert re.search(r"background run In\[3\] of kernel \d+ \(train\) running 0:0[3-9]", dashboard), dashboard

    open(late, "w").close()
    assert b.execute("%fsdp2 wait", timeout=60).status == "ok"
    run = b.execute("print(train.state, train.rank_states)")
    assert run.stdout == "done {0: 'done', 1: 'done'}\n", run.stdout
    shown = b.messages_for(attach.reply["parent_header"]["msg_id"],
                           lambda messages: sum("result'" in str(m["content"]) for m in messages) >= 2)
    text = str([m["content"] for m in shown])
    assert "'early result'" in text and "'late result'" in text, text  # rank 0's came after its end
    assert b.execute("%%fsdp2\nprint('free')").stdout == "[all] free\n"
    assert b.execute("%fsdp2 stop").status == "ok"


def test_a_run_that_failed_while_detached_shows_its_error_on_wait(kernels, tmpdir_env, tmp_path):
    """Every rank ended the run while no kernel held the pool: their replies were kept, and the
    kernel that attaches gets a handle that has ended, whose `%fsdp2 wait` shows the error."""
    go = str(tmp_path / "go")
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name failed --no-dashboard").status == "ok"
    run = a.execute(f"%%fsdp2 --bg --name job\n{_wait_for(go)}raise ValueError(f'late failure on {{rank}}')")
    assert run.status == "ok", run.stderr
    _sigkill(a)
    open(go, "w").close()

    b = kernels()
    assert "idle" in _pools_until(b, ", idle, ")
    run = b.execute("%fsdp2 attach failed --no-dashboard")
    assert run.status == "ok", run.stderr + run.traceback_text
    assert f"In[3] of kernel {a.pid} (job) ended while no kernel held the pool;" in run.stdout, run.stdout
    run = b.execute("%fsdp2 wait")
    assert run.status == "error", run.stdout + run.stderr
    assert "late failure on 0" in run.traceback_text and "late failure on 1" in run.traceback_text, run.traceback_text
    assert re.fullmatch(rf"In\[3\] of kernel {a.pid} \(job\) on ranks 0-1: failed on ranks 0-1 after \d+:\d\d; "
                        r"its output is under In\[\d+\], the attach cell, and in the rank logs in \S+\n",
                        run.stdout), run.stdout
    assert b.execute("print(job.state)").stdout == "failed\n"
    assert b.execute("%%fsdp2\nprint('after')").stdout == "[all] after\n"  # its error was seen: cells run
    assert b.execute("%fsdp2 stop").status == "ok"


def test_a_rank_that_dies_while_detached_leaves_the_others_and_one_line(kernels, tmpdir_env, tmp_path):
    killed = str(tmp_path / "kernel-killed")
    a = kernels()
    assert a.execute("%%fsdp2 --cpu 2 --keep --name hurt --no-dashboard\nx = rank + 40").status == "ok"
    agent = _agent_pid(tmpdir_env["TMPDIR"], "hurt")
    pids = a.execute("%%fsdp2\nimport os\nprint(os.getpid())").stdout
    survivor = int(re.search(r"\[0\] (\d+)", pids).group(1))
    assert a.execute(f"%%fsdp2 --bg --ranks 1\n{_wait_for(killed)}os._exit(3)").status == "ok"
    _sigkill(a)
    open(killed, "w").close()  # rank 1 exits 3 now, while no kernel holds the pool

    b = kernels()
    listing = _pools_until(b, "rank 1 died")
    assert "rank 1 died (exit code 3)" in listing and "`%fsdp2 restart`" in listing, listing
    assert psutil.pid_exists(agent) and psutil.Process(survivor).status() != psutil.STATUS_ZOMBIE
    run = b.execute("%fsdp2 attach hurt --no-dashboard")
    assert run.status == "ok", run.stderr + run.traceback_text
    lines = [line for line in run.stderr.splitlines() if "died" in line]
    assert len(lines) == 1, run.stderr
    assert "rank 1 died (exit code 3) while no kernel held the pool" in lines[0], lines
    assert "`%fsdp2 restart`" in lines[0], lines
    run = b.execute("%%fsdp2\nprint(rank, 'x' in globals())")  # the next cell restarts the pool, then runs
    assert run.stdout == "[0] 0 False\n[1] 1 False\n", run.stderr + run.traceback_text
    assert "rank 1 died (exit code 3)" in run.stderr and "the pool was restarted (--cpu 2)" in run.stderr, run.stderr
    assert b.execute("%fsdp2 pools").result_text.startswith("hurt: --cpu 2, held by kernel")
    assert b.execute("%fsdp2 stop").status == "ok"


def _answer_stdin(kernel: Kernel, code: str, answers: list[str], timeout: float = 120):
    """Run `code` allowing stdin; answer its input requests in order; returns (run, prompts)."""
    import queue
    import threading

    prompts: list[str] = []
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                request = kernel.client.get_stdin_msg(timeout=0.2)
            except queue.Empty:
                continue
            prompts.append(request["content"]["prompt"])
            kernel.client.input(answers.pop(0) if answers else "")

    msg_id = kernel.client.execute(code, allow_stdin=True)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        return kernel.collect(msg_id, code, timeout), prompts
    finally:
        done.set()
        thread.join(5)


def test_a_prompt_left_waiting_by_a_lost_kernel_is_asked_in_the_next(kernels, tmpdir_env):
    """input() on a rank whose kernel died waits; the attach cell says so, and `%fsdp2 wait`
    asks it in the new kernel's input box, as the lost cell would have, and the answer gets
    there; the debugger the cell opens next is served there too."""
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name ask --no-dashboard").status == "ok"
    a.client.execute("%%fsdp2 --ranks 0\nname = input('your name? ')\nbreakpoint()\nprint('hello', name)",
                     allow_stdin=True)
    asked = a.client.get_stdin_msg(timeout=60)  # the rank waits at its prompt; nobody answers here
    assert asked["content"]["prompt"] == "[0] your name? "
    _sigkill(a)

    b = kernels()
    assert "rank 0 waiting for input" in _pools_until(b, "waiting for input")
    run = b.execute("%fsdp2 attach ask --no-dashboard")
    assert run.status == "ok", run.stderr + run.traceback_text
    assert "In[3] of another kernel is still running on rank 0" in run.stdout, run.stdout
    assert "rank 0 of In[3] of another kernel waits for input" in run.stdout, run.stdout
    run, prompts = _answer_stdin(b, "%fsdp2 wait", ["Ada", "p name.upper()", "c"])
    assert run.status == "ok", run.stderr + run.traceback_text
    assert prompts[0] == "[0] your name? " and set(prompts[1:]) == {"[0] (Pdb) "}, prompts
    assert "[0] 'ADA'\n" in run.stdout, run.stdout  # the debugger's answer, under its prompt
    assert "[0] hello Ada\n" in run.stdout, run.stdout
    assert b.execute("%%fsdp2 --ranks 0\nprint(name)").stdout == "[0] Ada\n"
    assert b.execute("%fsdp2 stop").status == "ok"


OTHER_USER_SCRIPT = """
import os, sys
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

pool_dir, name, agent = sys.argv[1], sys.argv[2], int(sys.argv[3])
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fsdp2nb")
print("pools:", repr(shell.run_line_magic("fsdp2", "pools")))
try:
    shell.run_line_magic("fsdp2", f"attach {name} --no-dashboard")
except UsageError as error:
    print("attach by name:", error)
for reach in (lambda: os.listdir(pool_dir), lambda: open(os.path.join(pool_dir, "key")).read()):
    try:
        reach()
        print("reached", pool_dir)
    except PermissionError:
        print("denied")
# A pool directory of this user's own that names the other user's agent: its key is refused.
import json
from fsdp2nb.pool.kept import holder
from fsdp2nb.host.process_identity import process_key
mine = holder.kept_dir(name)
mine.mkdir(mode=0o700)
json.dump(dict(name=name, pool_id="x", devices=["cpu"], collective_timeout_s=60.0, keep_for_s=None,
               agent=list(process_key(agent)), log_dir=str(mine), runtime_dir=str(mine),
               created=0.0), open(mine / "pool.json", "w"))
(mine / "key").write_text("00" * 32)
os.chmod(mine / "key", 0o644)
try:
    shell.run_line_magic("fsdp2", f"attach {name} --no-dashboard")
except UsageError as error:
    print("attach of a forged pool:", error)
"""

OTHER_USER_ATTACH = """
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fsdp2nb")
try:
    shell.run_line_magic("fsdp2", "attach owned --no-dashboard")
except UsageError as error:
    print("attach with a key that is not mine:", error)
"""


@pytest.fixture
def other_user():
    """A second local user for the test's length (useradd; root only)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("needs root, useradd and runuser to create a second user")
    import subprocess

    name = f"kpother{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    yield name
    subprocess.run(["userdel", name], check=False)


IMPORTED_TOP_LEVELS = """
import importlib, pkgutil, sys
import IPython.core.interactiveshell, psutil
for package in ("fsdp2nb.frontend", "fsdp2nb.pool", "fsdp2nb.wire", "fsdp2nb.host", "fsdp2nb.widgets"):
    for module in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(module.name)
for module in list(sys.modules.values()):
    print(getattr(module, "__file__", None) or "")
"""


def _packages_every_user_reads(user: str, into: str) -> tuple[str, list[str]]:
    """An interpreter `user` may run, and a PYTHONPATH `user` may read, with the packages the
    other user's scripts import from this environment and checkout. They are hard links in a
    world-readable directory: a checkout in a private directory (as `mktemp -d` makes) is not
    readable by another user, and the venv's interpreter may live in root's home (pyenv)."""
    import subprocess
    import sys
    import sysconfig

    def runs(python: str) -> bool:
        return subprocess.run(["runuser", "-u", user, "--", python, "-c", "pass"], capture_output=True).returncode == 0

    python = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/local/bin:/usr/bin")
    if python is None or not runs(python):
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that user {user} may run")
    roots = [os.getcwd(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    files = subprocess.run([sys.executable, "-c", IMPORTED_TOP_LEVELS], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.split()
    top_levels = {os.path.join(root, os.path.relpath(path, root).split(os.sep)[0])
                  for path in files for root in roots if path.startswith(root + os.sep)}
    os.makedirs(into, exist_ok=True)
    try:
        for top in top_levels:
            target = os.path.join(into, os.path.basename(top))
            if os.path.isdir(top):
                shutil.copytree(top, target, copy_function=os.link, dirs_exist_ok=True)
            elif not os.path.exists(target):
                os.link(top, target)
    except OSError as error:  # another filesystem, say
        pytest.skip(f"cannot link this environment's packages where user {user} may read them: {error}")
    for directory, _, _ in os.walk(into):
        os.chmod(directory, 0o755)
    return python, [into]


def test_another_user_can_neither_list_nor_attach_a_kept_pool(kernels, tmpdir_env, other_user):
    import pwd
    import subprocess

    root = tmpdir_env["TMPDIR"]
    os.chmod(root, 0o1777)  # a shared temporary directory, as /tmp is
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 1 --keep --name private --no-dashboard").status == "ok"
    pool_dir = os.path.join(root, f"fsdp2nb-{os.getuid()}", "kept", "private")
    agent = _agent_pid(root, "private")
    other = pwd.getpwnam(other_user)
    ipython_dir = os.path.join(root, "other-ipython")
    os.mkdir(ipython_dir)
    os.chown(ipython_dir, other.pw_uid, other.pw_gid)
    python, path = _packages_every_user_reads(other_user, os.path.join(root, "packages"))
    env = {"PATH": os.environ["PATH"], "TMPDIR": root, "IPYTHONDIR": ipython_dir, "HOME": ipython_dir,
           "PYTHONPATH": os.pathsep.join(path), **WITHOUT_GPUS}
    done = subprocess.run(["runuser", "-u", other_user, "--", python, "-c", OTHER_USER_SCRIPT,
                           pool_dir, "private", str(agent)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ipython_dir)
    out = done.stdout
    assert "pools: no kept pools\n" in out, out + done.stderr
    assert "attach by name: no kept pool is named 'private'" in out, out + done.stderr
    assert out.count("denied\n") == 2 and "reached" not in out, out
    assert "attach of a forged pool:" in out and "readable by no one else (0600)" in out, out + done.stderr
    # The pool's real key, 0600, in a pool directory of the other user's: refused, as not theirs.
    owned = os.path.join(root, f"fsdp2nb-{other.pw_uid}", "kept", "owned")
    os.mkdir(owned, 0o700)
    for name in ("pool.json", "key"):
        shutil.copy2(os.path.join(pool_dir, name), os.path.join(owned, name))
    for path in (owned, os.path.join(owned, "pool.json")):
        os.chown(path, other.pw_uid, other.pw_gid)
    done = subprocess.run(["runuser", "-u", other_user, "--", python, "-c", OTHER_USER_ATTACH], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ipython_dir)
    assert "attach with a key that is not mine:" in done.stdout, done.stdout + done.stderr
    assert "must be this user's and readable by no one else" in done.stdout, done.stdout
    assert a.execute("%fsdp2 pools").result_text.startswith("private: --cpu 1, held by kernel")
    assert a.execute("%%fsdp2\nprint('mine')").stdout == "mine\n"
    assert a.execute("%fsdp2 stop").status == "ok"
