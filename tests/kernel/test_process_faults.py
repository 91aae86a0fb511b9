"""Process faults that used to hang a cell or mislead: a collective that not every rank entered,
a dying host agent, a rank closing its own stdout, and hostile user code."""

import contextlib
import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest

from tests.support.host_processes import wait_until_ended


def _agent_pid(kernel) -> int:
    run = kernel.execute("%%fsdp2 --ranks 0\nimport os\nprint(os.getppid())")
    assert run.status == "ok", run.traceback_text
    return int(run.stdout.split()[-1])


def _rank_pids(kernel) -> list[int]:
    run = kernel.execute("%%fsdp2\nimport os\nprint(rank, os.getpid())")
    assert run.status == "ok", run.traceback_text
    return [int(line.split()[-1]) for line in run.stdout.splitlines()]


# --- a collective that not every rank entered -----------------------------------------------------


def test_waiting_cell_shows_where_each_rank_is(kernel):
    lines = []

    def on_message(message):
        if message["msg_type"] in ("display_data", "update_display_data"):
            text = message["content"]["data"].get("text/plain", "")
            if "all_reduce" in text and not lines:
                lines.append(text)
                kernel.manager.interrupt_kernel()  # as a user who read the line would

    code = "%%fsdp2\nkept = 1\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\n"
    run = kernel.execute(code, timeout=120, on_message=on_message)
    assert lines, "no waiting line named the collective"
    assert "[0] in all_reduce at In[" in lines[0] and "line 4: dist.all_reduce(t)" in lines[0], lines[0]
    assert "[1] finished" in lines[0], lines[0]
    text = run.traceback_text
    assert run.status == "error"
    # Rank 0 is released from its collective at the interrupt, and no rank loses its state.
    assert "[0] rank 0: waited in all_reduce, which could not complete" in text, text
    assert "released rank(s) 0 from all_reduce" in text and "re-formed in place" in text, text
    assert "raised KeyboardInterrupt" not in text
    assert kernel.execute("%%fsdp2\nprint('kept' in globals())").stdout == "[all] True\n"


def test_a_collective_one_rank_waits_in_while_the_other_computes_shows_who_waits_where(kernel):
    """Rank 0's count of collectives stalls in all_reduce while rank 1 is elsewhere: a hang."""
    lines = []

    def on_message(message):
        if message["msg_type"] in ("display_data", "update_display_data"):
            text = message["content"]["data"].get("text/plain", "")
            if "all_reduce" in text and not lines:
                lines.append(text)
                kernel.manager.interrupt_kernel()  # as a user who read the line would

    code = ("%%fsdp2\nimport time\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\n"
            "else:\n    while True:\n        time.sleep(0.05)\n")
    run = kernel.execute(code, timeout=120, on_message=on_message)
    assert lines, "no waiting line named the collective"
    assert "[0] in all_reduce at In[" in lines[0] and "line 4: dist.all_reduce(t)" in lines[0], lines[0]
    assert "[1] at In[" in lines[0] and "line 7: time.sleep(0.05)" in lines[0], lines[0]
    assert run.status == "error"
    assert kernel.execute("%%fsdp2\nprint('usable')").stdout == "[all] usable\n"


def test_a_quiet_loop_of_collectives_shows_no_waiting_line(kernel):
    """Every rank in the same collective, over and over, is a loop at work, not a hang."""
    # Rank 0 says through the all_reduce itself when 8 s have passed, so every rank makes the same
    # calls and leaves together: past WAITING_REPORT_S (3 s), then samples 2 s apart.
    code = ("%%fsdp2\nimport time\nt = torch.ones(2_000_000)\nend = time.monotonic() + 8\n"
            "while True:\n"
            "    t[0] = float(rank == 0 and time.monotonic() > end)\n"
            "    dist.all_reduce(t)\n"
            "    if t[0] > 0:\n"
            "        break\n")
    run = kernel.execute(code, timeout=120)
    assert run.status == "ok", run.traceback_text
    assert not any("waiting" in text for text in _shown_lines(run)), _shown_lines(run)


@contextlib.contextmanager
def _busy_machine():
    """A process spinning on a core for as long as the block runs, as another user's job would."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def test_a_loop_of_collectives_with_one_rank_slower_shows_no_waiting_line(kernel):
    """Rank 1 sleeps between its collectives on a busy machine, so rank 0 is almost always caught
    waiting in all_reduce and rank 1 in its sleep: every sample shows the positions of a hang, yet
    both ranks move on, which their counts of collectives entered show."""
    code = ("%%fsdp2\nimport time\nt = torch.ones(1000)\nend = time.monotonic() + 8\n"
            "while True:\n"
            "    t[0] = float(rank == 0 and time.monotonic() > end)\n"
            "    dist.all_reduce(t)\n"
            "    if t[0] > 0:\n"
            "        break\n"
            "    if rank == 1:\n"
            "        time.sleep(0.05)\n")
    with _busy_machine():
        run = kernel.execute(code, timeout=120)
    assert run.status == "ok", run.traceback_text
    assert not any("waiting" in text for text in _shown_lines(run)), _shown_lines(run)


def _shown_lines(run) -> list[str]:
    return [m["content"]["data"].get("text/plain", "") for m in run.messages
            if m["msg_type"] in ("display_data", "update_display_data")]


def test_a_collective_of_every_rank_in_a_cell_of_some_is_released_and_state_kept(kernel):
    # Longer than the quiet time after which the waiting line appears, so that it shows first.
    assert kernel.execute("%fsdp2 restart --cpu 2 --timeout 60").status == "ok"
    try:
        assert kernel.execute("%%fsdp2\nkept = 'yes'").status == "ok"
        run = kernel.execute("%%fsdp2 --ranks 1\nt = torch.ones(1)\ndist.all_reduce(t)", timeout=120)
        assert run.status == "error"
        text = run.traceback_text
        assert "released rank(s) 1 from all_reduce" in text and "runs on some ranks only" in text, text
        line = [m["content"]["data"]["text/plain"] for m in run.messages if m["msg_type"] == "display_data"]
        assert line and "[1] in all_reduce at In[" in line[0] and "[0] not running this cell" in line[0], line
        assert "re-formed in place" in text and "broken" not in text
        after = kernel.execute("%%fsdp2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(kept, t.item())")
        assert after.stdout == "[all] yes 2.0\n", after.traceback_text
    finally:
        assert kernel.execute("%fsdp2 restart --cpu 2").status == "ok"


def test_a_checkpointer_collective_times_out_with_the_pool(kernel, tmp_path):
    """The checkpointer's own groups wait as long as `--timeout`, not torch's 30 minutes, and
    a collective that timed out costs no state: the groups are re-formed in place."""
    assert kernel.execute("%fsdp2 restart --cpu 2 --timeout 3").status == "ok"
    try:
        code = (f"%%fsdp2\nimport fsdp2nb\nmodel = torch.nn.Linear(4, 4)\n"
                f"ckpt = fsdp2nb.Checkpointer({str(tmp_path / 'ckpt')!r}, async_save=False).track(model=model)\n"
                f"if rank == 0:\n    ckpt.save(1)  # rank 1 never joins\n")
        run = kernel.execute(code, timeout=120)
        text = run.traceback_text
        assert run.status == "error" and "rank 0 raised" in text and "re-formed in place" in text, text
        assert "restarted" not in text
        after = kernel.execute("%%fsdp2\nprint(type(model).__name__)")
        assert after.stdout == "[all] Linear\n", after.traceback_text
    finally:
        assert kernel.execute("%fsdp2 restart --cpu 2").status == "ok"


def test_waiting_line_names_a_stopped_rank(kernel):
    pid = _rank_pids(kernel)[1]
    seen = []

    def on_message(message):
        if message["msg_type"] in ("display_data", "update_display_data") and not seen:
            text = message["content"]["data"].get("text/plain", "")
            if "stopped by a signal" in text:
                seen.append(text)
                os.kill(pid, signal.SIGCONT)  # as a user who read the line would

    threading.Timer(1.0, os.kill, (pid, signal.SIGSTOP)).start()
    code = "%%fsdp2\nimport time\nt = torch.ones(1)\nfor _ in range(150):\n    dist.all_reduce(t)\n    time.sleep(0.02)\n"
    run = kernel.execute(code, timeout=120, on_message=on_message)
    os.kill(pid, signal.SIGCONT)
    assert seen and f"[1] stopped by a signal (`kill -CONT {pid}` resumes it" in seen[0], seen
    assert run.status == "ok", run.traceback_text


def test_a_press_after_an_automatic_release_keeps_the_pool(kernel, tmp_path):
    """Rank 0 raises at the first press while rank 1, which ignores SIGINT, sits in a barrier: the
    wait releases the collectives on its own. The next press asks for that release, already under
    way, and every rank keeps its state (such a press once restarted the pool). Rank 1 goes on
    ignoring SIGINT until the test has pressed: a press after the cell would hit the next one."""
    pressed = str(tmp_path / "pressed-twice")
    pids = _rank_pids(kernel)
    assert kernel.execute("%%fsdp2\nkept = 'yes'").status == "ok"
    presses = []

    def on_message(message):
        text = message["content"].get("text", "") if message["msg_type"] == "stream" else ""
        if ("waiting" in text and not presses) or ("released" in text and len(presses) == 1):
            presses.append(text)
            kernel.manager.interrupt_kernel()
            if len(presses) == 2:
                open(pressed, "w").close()

    code = ("%%fsdp2\nimport os, signal, time\nprint('waiting', flush=True)\n"
            "if rank == 0:\n    time.sleep(60)\n"
            "else:\n    before = signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "    try:\n        dist.barrier()\n    except RuntimeError:\n        print('released', flush=True)\n"
            f"    while not os.path.exists({pressed!r}):\n        time.sleep(0.05)\n"
            "    signal.signal(signal.SIGINT, before)\n")
    run = kernel.execute(code, timeout=120, on_message=on_message)
    assert len(presses) == 2 and run.status == "error", (presses, run.traceback_text)
    text = run.traceback_text + run.stderr
    assert "re-formed in place" in text and "restarted" not in text, text
    assert _rank_pids(kernel) == pids
    assert kernel.execute("%%fsdp2\nprint(kept)").stdout == "[all] yes\n"


def test_a_press_just_after_the_stop_ended_the_cell_is_dropped(kernel):
    """The second half of a double press that lands once the ranks' cell has ended (here while a
    slow post_run_cell hook runs) would raise KeyboardInterrupt in the kernel's own code after the
    cell (in ipykernel, the cell's reply is then lost); it is dropped."""
    hook = ("import time\n_slow_after = lambda result: time.sleep(1.5)\n"
            "get_ipython().events.register('post_run_cell', _slow_after)")
    assert kernel.execute(hook).status == "ok"
    presses = []

    def on_message(message):
        text = message["content"].get("text", "") if message["msg_type"] == "stream" else ""
        if "sleeping" in text and not presses:
            presses.append("first")
            kernel.manager.interrupt_kernel()
        if message["msg_type"] == "error" and len(presses) == 1:
            presses.append("second")  # the cell's error is out: the wait has ended
            kernel.manager.interrupt_kernel()

    try:
        run = kernel.execute("%%fsdp2\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)",
                             timeout=120, on_message=on_message)
    finally:
        kernel.execute("get_ipython().events.unregister('post_run_cell', _slow_after)")
    assert presses == ["first", "second"] and run.status == "error"
    assert "raised KeyboardInterrupt" in run.traceback_text
    assert "Error in callback" not in run.stdout + run.stderr, run.stdout + run.stderr


# --- the host agent dying -------------------------------------------------------------------------


@pytest.mark.parametrize(("signum", "how"), [(signal.SIGKILL, "killed by SIGKILL"),
                                             (signal.SIGTERM, "ended by a SIGTERM it was sent")])
def test_agent_dying_mid_cell_ends_the_cell_and_restarts_the_pool(kernel, signum, how):
    agent = _agent_pid(kernel)
    code = (f"%%fsdp2\nimport os, time\nkept = 1\nif rank == 0:\n    os.kill(os.getppid(), {int(signum)})\n"
            "time.sleep(60)")
    run = kernel.execute(code, timeout=120)
    assert run.status == "error"
    text = run.traceback_text
    assert f"the host agent (pid {agent}) {how}" in text, text
    assert "ended with its host agent" in text and "the pool was restarted" in text
    after = kernel.execute("%%fsdp2\nprint('kept' in globals())")
    assert after.status == "ok" and after.stdout == "[all] False\n"


def test_agent_killed_while_idle_is_reported_and_the_next_cell_restarts(kernel):
    agent = _agent_pid(kernel)
    os.kill(agent, signal.SIGKILL)
    wait_until_ended(agent)
    status = kernel.execute("%fsdp2 status")
    assert status.status == "ok"
    assert f"broken: the host agent (pid {agent}) killed by SIGKILL" in status.stdout, status.stdout
    assert " idle " not in status.stdout and status.stdout.count("exited") == 2, status.stdout
    run = kernel.execute("%%fsdp2\nprint('fresh')")
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] fresh\n"
    assert "while the pool was idle" in run.stderr and "the pool was restarted" in run.stderr
    assert "BrokenPipeError" not in run.stderr


def test_rank_gone_unreported_fails_the_next_cell_plainly(kernel):
    ranks, agent = _rank_pids(kernel), _agent_pid(kernel)
    os.kill(agent, signal.SIGSTOP)  # it can neither collect the rank nor report its end
    try:
        os.kill(ranks[1], signal.SIGKILL)
        wait_until_ended(ranks[1])  # gone before the cell is sent, as a rank that died between cells
        run = kernel.execute("%%fsdp2\nprint('ran')", timeout=120)
    finally:
        if psutil.pid_exists(agent):
            os.kill(agent, signal.SIGCONT)
    assert run.status == "error"
    text = run.traceback_text
    assert "could not be reached" in text and "the pool was restarted" in text, text
    assert "Traceback" not in text and "BrokenPipeError" not in text
    assert kernel.execute("%%fsdp2\nprint('fresh')").stdout == "[all] fresh\n"


# --- a rank closing its own output ----------------------------------------------------------------


@pytest.mark.parametrize(("fd", "name"), [(1, "stdout"), (2, "stderr")])
def test_rank_closing_its_output_fd_keeps_its_state_and_output(kernel, fd, name):
    run = kernel.execute(f"%%fsdp2\nimport os\nkept = rank * 10\nif rank == 1:\n    os.close({fd})\n")
    assert run.status == "ok", run.traceback_text
    assert f"[1] fd {fd} ({name}) was closed by the cell" in run.stdout + run.stderr
    after = kernel.execute("%%fsdp2\nprint(kept)\nos.system('echo from a child')")
    assert after.status == "ok", after.traceback_text
    assert "[0] 0\n" in after.stdout and "[1] 10\n" in after.stdout
    assert "[all] from a child\n" in after.stdout


# --- hostile user code ----------------------------------------------------------------------------


def test_stopped_rank_is_called_stopped(kernel):
    code = ("%%fsdp2\nimport os, signal, time\npids = [None] * world_size\n"
            "dist.all_gather_object(pids, os.getpid())\n"
            "if rank == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "else:\n    while open(f'/proc/{pids[1]}/stat').read().rsplit(') ', 1)[1][0] != 'T':\n"
            "        time.sleep(0.05)\n    print('peer stopped', flush=True)\n"
            "time.sleep(120)")
    run = kernel.execute_and_interrupt(code, when_printed="peer stopped")
    assert run.status == "error"
    text = run.traceback_text
    assert "[1] rank 1: is stopped by a signal (SIGSTOP or SIGTSTP)" in text, text
    assert "(stopped: rank(s) 1)" in text and "stuck" not in text
    assert "state was lost" in text
    assert kernel.execute("%%fsdp2\nprint('usable')").stdout == "[all] usable\n"


def test_sys_exit_fails_the_cell_and_keeps_the_rank(kernel):
    kernel.execute("%%fsdp2\nkept = rank")
    run = kernel.execute("%%fsdp2\nimport sys\nif rank == 1:\n    sys.exit(4)")
    assert run.status == "error" and "[1] rank 1 raised SystemExit" in run.traceback_text
    assert kernel.execute("%%fsdp2\nprint(kept)").stdout in ("[0] 0\n[1] 1\n", "[1] 1\n[0] 0\n")


def test_runaway_recursion_fails_the_cell_and_keeps_the_ranks(kernel):
    kernel.execute("%%fsdp2\nkept = rank")
    run = kernel.execute("%%fsdp2\ndef dive(n):\n    return dive(n + 1)\ndive(0)")
    assert run.status == "error" and "RecursionError" in run.traceback_text
    assert len(run.traceback_text) < 20_000  # repeated frames folded, not thousands of lines
    assert kernel.execute("%%fsdp2\nprint(kept)").stdout in ("[0] 0\n[1] 1\n", "[1] 1\n[0] 0\n")


def test_huge_print_is_cut_and_the_kernel_stays_small(kernel):
    kernel_process = psutil.Process(kernel.pid)
    before = kernel_process.memory_info().rss
    run = kernel.execute("%%fsdp2\nimport sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n"
                         "print()\nprint('after', flush=True)", timeout=300)
    assert run.status == "ok", run.traceback_text
    assert "output truncated after 200,000 characters" in run.stdout
    assert len(run.stdout) < 2 * 200_000 + 2_000
    grown = kernel_process.memory_info().rss - before
    assert grown < 100 * 2**20, f"the kernel grew by {grown / 2**20:.0f} MiB for 200 MB of rank output"
    assert kernel.execute("%%fsdp2\nprint('usable')").stdout == "[all] usable\n"


def test_pulling_an_unpicklable_value_says_why_in_one_line(kernel):
    assert kernel.execute("%%fsdp2\nimport threading\nlock = threading.Lock()").status == "ok"
    run = kernel.execute("value = %fsdp2 pull lock --value")
    assert run.status == "error"
    assert "'lock' cannot be sent to the notebook" in run.traceback_text, run.traceback_text
    assert kernel.execute("%%fsdp2\nprint(lock.locked())").stdout == "[all] False\n"
