"""A pool restarted after a crash forks its ranks from the standby agent (torch already imported):
the ranks are new, form a new process group, and the cell says that rank state was lost and how
to resume. The standby leaves no process, registry entry or directory behind; the first pool forks
from the one that loading the extension started."""

import contextlib
import json
import os
import signal

import psutil
import pytest

from fsdp2nb.pool import reaper
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

_AGENTS = ("from fsdp2nb import _session\nimport json\n"
           "print(json.dumps([_session.pool._launched.process_ids()[0], _session.launcher.standby_pid(),"
           " _session.launcher._standby and str(_session.launcher._standby.log_dir),"
           " _session.launcher._standby and _session.launcher._standby.standby_id]))")
_RANK_FACTS = "%%fsdp2\nimport os\nprint(os.getpid(), os.environ['TORCHELASTIC_RUN_ID'])"
_KILL = {
    "a rank killed": "%%fsdp2\nimport os, time\nkept = 1\nif rank == 1:\n    os.kill(os.getpid(), 9)\ntime.sleep(60)",
    "the agent killed": "%%fsdp2\nimport os, time\nkept = 1\nif rank == 0:\n    os.kill(os.getppid(), 9)\ntime.sleep(60)",
}
_STUCK = ("%%fsdp2\nimport signal, time\nkept = 1\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
          "print('waiting', flush=True)\ntime.sleep(120)")


def _agents(kernel: Kernel) -> tuple[int, int | None, str | None, str | None]:
    """The pool's agent pid, and the standby's pid, log directory and registry id."""
    run = kernel.execute(_AGENTS)
    assert run.status == "ok", run.traceback_text
    return tuple(json.loads(run.stdout))


def _rank_facts(kernel: Kernel) -> set[tuple[str, str]]:
    """(pid, pool id) per rank: the pool id names the run whose FileStore formed the group."""
    run = kernel.execute(_RANK_FACTS)
    assert run.status == "ok", run.traceback_text
    return {tuple(line.split()[1:]) for line in run.stdout.splitlines()}


@pytest.mark.parametrize("how", ["a rank killed", "the agent killed", "a rank stuck", "%fsdp2 restart"])
def test_a_restart_forks_fresh_ranks_from_the_standby_into_a_new_group(kernel, how):
    assert kernel.execute("%%fsdp2\nkept = rank + 40").status == "ok"
    agent, standby, _, _ = _agents(kernel)
    assert standby is not None and standby != agent
    before = _rank_facts(kernel)
    if how == "%fsdp2 restart":
        assert kernel.execute(how).status == "ok"
    else:
        if how == "a rank stuck":  # it ignores the stop button: the pool is restarted 5 s later
            run = kernel.execute_and_interrupt(_STUCK, when_printed="waiting")
        else:
            run = kernel.execute(_KILL[how], timeout=120)
        assert run.status == "error"
        text = run.traceback_text
        assert "the pool was restarted (--cpu 2) and all rank state was lost" in text, text
        assert 'to resume, run the cells that set up the ranks again' in text and 'ckpt.load("latest")' in text
    new_agent, new_standby, _, _ = _agents(kernel)
    assert new_agent == standby, "the new pool did not use the standby agent"
    assert new_standby not in (None, agent, standby)  # the next restart has one too
    after = _rank_facts(kernel)
    assert len(after) == 2 and not {pid for pid, _ in after} & {pid for pid, _ in before}
    assert len({pool for _, pool in after}) == 1 and not {pool for _, pool in after} & {pool for _, pool in before}
    run = kernel.execute("%%fsdp2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()), 'kept' in globals())")
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] 2 False\n"  # the new group works, and the old state is gone


def _still_there(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("how", ["%fsdp2 stop", "kernel SIGKILL"])
def test_the_standby_leaves_nothing_behind(how):
    own = Kernel(env=WITHOUT_GPUS)
    try:
        assert own.execute("%load_ext fsdp2nb").status == "ok"
        assert own.execute("%fsdp2 start --cpu 2").status == "ok"
        _, standby, log_dir, standby_id = _agents(own)
        processes = psutil.Process(own.pid).children(recursive=True)
        assert len(processes) == 4  # the host agent, two ranks and the standby agent
        assert standby in [p.pid for p in processes] and os.path.isdir(log_dir)
        if how == "%fsdp2 stop":
            assert own.execute(how).stdout == "pool stopped\n"
            assert not psutil.Process(own.pid).children(recursive=True)
        else:  # the standby may still be importing torch: it exits once it reads end of file
            os.kill(own.pid, signal.SIGKILL)
            own.manager.provisioner.process.wait(timeout=10)
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert not [p.pid for p in alive if _still_there(p.pid)], "a pool process outlived its pool"
        assert not os.path.exists(log_dir)  # the standby removed it on its way out
        if how == "kernel SIGKILL":
            reaper.reap_orphans()  # as the next pool's start does: the dead kernel's entries go
        assert not (reaper.state_dir() / "pools" / f"{standby_id}.json").exists()
    finally:
        if how == "kernel SIGKILL":
            own.client.stop_channels()
            own.manager.cleanup_resources()
        else:
            own.stop()


def test_the_first_start_forks_from_the_standby_that_loading_the_extension_started():
    """`%load_ext` starts the first pool's agent while the user is busy: the first cell's start
    hands it the plan. With FSDP2NB_STANDBY=0, loading starts no process."""
    own = Kernel(env=WITHOUT_GPUS)
    try:
        assert own.execute("%load_ext fsdp2nb").status == "ok"
        loaded = own.execute("from fsdp2nb import _session\nprint(_session.launcher.standby_pid())")
        standby = int(loaded.stdout)
        assert [p.pid for p in psutil.Process(own.pid).children(recursive=True)] == [standby]
        assert own.execute("%fsdp2 start --cpu 2").status == "ok"
        agent, next_standby, _, _ = _agents(own)
        assert agent == standby and next_standby not in (None, standby)
    finally:
        own.stop()
    without = Kernel(env={**WITHOUT_GPUS, "FSDP2NB_STANDBY": "0"})
    try:
        assert without.execute("%load_ext fsdp2nb").status == "ok"
        assert not psutil.Process(without.pid).children(recursive=True)
    finally:
        without.stop()


@pytest.mark.timeout(120)
def test_the_first_start_is_not_held_up_by_a_process_the_kernel_forked():
    """A process forked from the kernel after loading (a multiprocessing pool, say) holds the
    standby's stdin open: the agent reads its plan to the end of its line, not of the pipe."""
    own = Kernel(env=WITHOUT_GPUS)
    child = None
    try:
        assert own.execute("%load_ext fsdp2nb").status == "ok"
        forked = own.execute("import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(300)\n"
                             "    os._exit(0)\nprint(child)")
        child = int(forked.stdout)
        started = own.execute("%fsdp2 start --cpu 2 --no-dashboard", timeout=110)
        assert started.status == "ok", started.stderr
        assert own.execute("%%fsdp2\nprint(rank)").stdout == "[0] 0\n[1] 1\n"
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        own.stop()
