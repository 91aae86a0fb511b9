"""Kept pools through real kernels: ranks and their names outlive the kernel that started them.

Every test gives its kernels a TMPDIR of its own, so that the kept pools (under the user's state
directory there) of one test, or of another checkout's tests, are never seen by another.
"""

import glob
import os
import shutil
import signal
import stat
import tempfile
import time

import psutil
import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel

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
    started: list[Kernel] = []

    def start() -> Kernel:
        kernel = Kernel(env=tmpdir_env)
        started.append(kernel)
        assert kernel.execute("%load_ext fsdp2nb").status == "ok"
        return kernel

    yield start
    for kernel in started:
        try:
            kernel.stop()
        except Exception:
            pass


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
    time.sleep(1)
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


def test_a_pool_without_keep_still_dies_with_its_kernel(kernels):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --no-dashboard").status == "ok"
    agents = [p for p in psutil.Process(a.pid).children() if "fsdp2nb.worker.agent" in " ".join(p.cmdline())]
    assert agents
    ranks = [child for agent in agents for child in agent.children()]
    _sigkill(a)
    assert all(_gone(p.pid) for p in agents + ranks)


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


def test_restart_keeps_a_kept_pool_kept(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name again --no-dashboard").status == "ok"
    first = _agent_pid(tmpdir_env["TMPDIR"], "again")
    run = a.execute("%fsdp2 restart")
    assert run.status == "ok", run.stderr
    second = _agent_pid(tmpdir_env["TMPDIR"], "again")
    assert second != first and _gone(first)
    assert a.execute("%fsdp2 pools").result_text.startswith("again: --cpu 2, held by kernel")
    assert a.execute("%fsdp2 stop").status == "ok"


def test_keep_for_ends_an_unheld_idle_pool(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name brief --keep-for 3s --no-dashboard").status == "ok"
    agent = _agent_pid(tmpdir_env["TMPDIR"], "brief")
    assert "ends in" not in a.execute("%fsdp2 pools").result_text  # held: the clock does not run
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


def test_a_background_run_goes_on_while_detached(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name bg --no-dashboard").status == "ok"
    code = ("%%fsdp2 --bg --name train\nimport time\nfor step in range(30):\n"
            "    print('step', step, flush=True)\n    time.sleep(1)\ndone = True")
    assert a.execute(code).status == "ok"
    time.sleep(2)
    _sigkill(a)
    time.sleep(1)

    b = kernels()
    assert "In[" in b.execute("%fsdp2 pools").result_text  # the run shows while detached
    run = b.execute("%fsdp2 attach bg --no-dashboard")
    assert run.status == "ok", run.stderr
    assert "last lines of rank 0's log" in run.stdout and "  step " in run.stdout, run.stdout
    assert "is still running" in run.stdout, run.stdout
    run = b.execute("%fsdp2 wait")
    assert run.status == "ok", run.stderr
    assert b.execute("%%fsdp2\nprint(done)").stdout == "[all] True\n"
    logs = glob.glob(os.path.join(tmpdir_env["TMPDIR"], f"fsdp2nb-{os.getuid()}", "logs", "*", "rank-0.log"))
    with open(logs[0]) as log:
        assert "step 5\n" in log.read()  # printed while no kernel held the pool: in the rank's log
    assert b.execute("%fsdp2 stop").status == "ok"


def test_interrupt_acts_on_a_run_of_the_lost_kernel(kernels, tmpdir_env):
    a = kernels()
    assert a.execute("%fsdp2 start --cpu 2 --keep --name stuck --no-dashboard").status == "ok"
    assert a.execute("%%fsdp2 --bg\nimport time\ntime.sleep(600)").status == "ok"
    time.sleep(1)
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
for _ in range(200):  # the request came on the control connection: wait until it is here
    if process_requests().pending():
        break
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
    assert b.execute("import fsdp2nb\nfsdp2nb._session.pool.request_save()").status == "ok"
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
