"""`%%fsdp2 --bg` through a real kernel: output lands in the run's own cell while other cells
run, later cells queue behind the run, errors and interrupts reach the right cell.

Runs are held at a point by a flag file that the test creates when it has checked what it must
see while the run is going, so nothing here depends on timing."""

import os
import re
import tempfile

import pytest


def _flag() -> str:
    return os.path.join(tempfile.mkdtemp(), "go")


def _wait_for(flag: str) -> str:
    """Rank code that blocks until the test creates `flag` (a minute at most)."""
    return (f"import os, time\ndeadline = time.time() + 60\n"
            f"while not os.path.exists({flag!r}) and time.time() < deadline:\n    time.sleep(0.01)\n")


def _go(flag: str) -> None:
    open(flag, "w").close()


def _streams(messages: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")


def _has_error(messages: list[dict]) -> bool:
    return any(m["msg_type"] == "error" for m in messages)


def _start_bg(kernel, line: str, body: str) -> str:
    """Run a `%%fsdp2 LINE` background cell; returns its msg_id (the parent of its output)."""
    run = kernel.execute(f"%%fsdp2 {line}\n{body}")
    assert run.status == "ok", run.traceback_text
    assert "<fsdp2 background run In[" in run.displays[-1]["data"]["text/plain"]
    kernel.other_messages.extend(run.messages)  # what the run sent before its cell returned
    return run.reply["parent_header"]["msg_id"]


def test_output_streams_into_its_own_cell_while_other_cells_run(kernel):
    flag = _flag()
    bg_id = _start_bg(kernel, "--bg --name streamer",
                      "print('bg before', flush=True)\n" + _wait_for(flag) +
                      "print('bg after', rank)\nfrom IPython.display import HTML, display\n"
                      "display(HTML(f'<i>bg {rank}</i>'))")
    kernel.messages_for(bg_id, lambda ms: "bg before" in _streams(ms))
    plain = kernel.execute("print('plain cell', streamer.done(), streamer.state)")
    assert plain.stdout == "plain cell False running\n"
    status = kernel.execute("%fsdp2 status")  # answered while the run goes, not queued
    assert status.status == "ok" and [line.split()[3] for line in status.stdout.splitlines()
                                      if line[:2] in ("0 ", "1 ")] == ["busy", "busy"], status.stdout
    _go(flag)
    waited = kernel.execute("%fsdp2 wait streamer")
    assert waited.status == "ok", waited.traceback_text
    mine = kernel.messages_for(bg_id, lambda ms: "bg after" in _streams(ms))
    assert "[all] bg before\n" in _streams(mine)
    assert "[0] bg after 0\n" in _streams(mine) and "[1] bg after 1\n" in _streams(mine)
    html = sorted(m["content"]["data"]["text/html"] for m in mine if m["msg_type"] == "display_data")
    assert html == ["<i>bg 0</i>", "<i>bg 1</i>"]
    every_bg_line = [m for m in [*plain.messages, *waited.messages, *kernel.other_messages]
                     if m["msg_type"] == "stream" and "bg " in m["content"]["text"]]
    assert every_bg_line and all(m["parent_header"]["msg_id"] == bg_id for m in every_bg_line)
    after = kernel.execute("print(streamer.state, streamer.rank_states)")
    assert after.stdout == "done {0: 'done', 1: 'done'}\n"


def test_a_later_cell_waits_for_the_run_then_runs(kernel):
    flag = _flag()
    _start_bg(kernel, "--bg", "order = ['bg']\n" + _wait_for(flag) + "order.append('bg end')")
    queued_id = kernel.submit("%%fsdp2\norder.append('queued')\nprint(order)")
    kernel.messages_for(queued_id, lambda ms: "waiting for In[" in _streams(ms))
    _go(flag)
    queued = kernel.collect(queued_id)
    assert queued.status == "ok", queued.traceback_text
    assert queued.stdout.startswith("waiting for In[")
    assert "[all] ['bg', 'bg end', 'queued']\n" in queued.stdout


def test_a_cell_queued_behind_a_failed_run_fails_with_its_error(kernel):
    flag = _flag()
    bg_id = _start_bg(kernel, "--bg", _wait_for(flag) + "raise ValueError('bg boom')")
    queued_id = kernel.submit("%%fsdp2\nprint('queued cell ran')")
    kernel.messages_for(queued_id, lambda ms: "waiting for In[" in _streams(ms))
    _go(flag)
    queued = kernel.collect(queued_id)
    assert queued.status == "error"
    assert "ValueError: bg boom" in queued.traceback_text and "so this cell did not run" in queued.traceback_text
    assert "queued cell ran" not in queued.stdout
    bg_error = [m for m in kernel.messages_for(bg_id, _has_error) if m["msg_type"] == "error"]
    assert "bg boom" in "\n".join(bg_error[0]["content"]["traceback"])
    again = kernel.execute("%%fsdp2\nprint('runs again')")  # the error was passed on once
    assert again.status == "ok" and "[all] runs again\n" in again.stdout


def test_wait_raises_the_runs_error(kernel):
    _start_bg(kernel, "--bg", "1 / 0")
    run = kernel.execute("run = _\ntry:\n    run.wait()\nexcept Exception as error:\n"
                         "    print(type(error).__name__, error)\nprint(run.state)")
    # Every rank raises; which one the message names first depends on which reply came first.
    assert re.fullmatch(r"RankError ranks? [0-9, and]+ raised ZeroDivisionError: division by zero\nfailed\n",
                        run.stdout), run.stdout
    after = kernel.execute("%%fsdp2\nprint('after a seen error')")  # wait() showed it: not passed on
    assert after.status == "ok" and "[all] after a seen error\n" in after.stdout


def test_interrupt_stops_the_run_on_every_rank(kernel):
    bg_id = _start_bg(kernel, "--bg --name looper",
                      "import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)")
    kernel.messages_for(bg_id, lambda ms: "looping" in _streams(ms))
    sent = kernel.execute("%fsdp2 interrupt looper")
    assert sent.stdout.startswith("interrupt sent to In[")
    waited = kernel.execute("%fsdp2 wait looper")
    assert waited.status == "error" and "KeyboardInterrupt" in waited.traceback_text
    state = kernel.execute("print(looper.state, looper.rank_states)")
    assert state.stdout == "interrupted {0: 'failed', 1: 'failed'}\n"
    after = kernel.execute("%%fsdp2\nprint('after interrupt')")  # an asked-for stop is not passed on
    assert after.status == "ok" and "[all] after interrupt\n" in after.stdout


def test_stop_button_while_idle_leaves_the_run_alone(kernel):
    flag = _flag()
    bg_id = _start_bg(kernel, "--bg --name survivor",
                      "print('started', flush=True)\n" + _wait_for(flag) + "print('survived')")
    kernel.messages_for(bg_id, lambda ms: "started" in _streams(ms))
    kernel.manager.interrupt_kernel()
    _go(flag)
    waited = kernel.execute("%fsdp2 wait survivor")
    assert waited.status == "ok", waited.traceback_text
    assert "[all] survived\n" in _streams(kernel.messages_for(bg_id, lambda ms: "survived" in _streams(ms)))


@pytest.mark.parametrize("line", ["--name train", "--bg --name 'not a name'", "--bg --name for"])
def test_bad_background_lines_get_one_usage_line(kernel, line):
    run = kernel.execute(f"%%fsdp2 {line}\nprint('ran')")
    usage = [text for text in run.stderr.splitlines() if text.startswith("UsageError: ")]
    assert run.status == "error" and len(usage) == 1 and "--name" in usage[0]
    assert "ran" not in run.stdout


def test_unknown_run_name_is_a_usage_error(kernel):
    run = kernel.execute("%fsdp2 wait no_such_run")
    assert run.status == "error"
    assert "UsageError: no background run is called 'no_such_run'" in run.stderr


def test_a_rank_dying_is_reported_in_the_runs_cell(kernel):
    flag = _flag()
    bg_id = _start_bg(kernel, "--bg", _wait_for(flag) + "import os, signal\n"
                      "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)")
    _go(flag)
    mine = kernel.messages_for(bg_id, _has_error)  # no later cell needed to see it
    text = "\n".join(m["content"]["traceback"][0] + "\n".join(m["content"]["traceback"])
                     for m in mine if m["msg_type"] == "error")
    assert "rank 1" in text and "SIGKILL" in text and "the pool was restarted" in text
    queued = kernel.execute("%%fsdp2\nprint('after the death')")  # in sequence it would fail too
    assert queued.status == "error" and "rank 1: killed by SIGKILL" in queued.traceback_text
    fresh = kernel.execute("%%fsdp2\nprint('fresh pool', rank)")
    assert fresh.status == "ok" and "[0] fresh pool 0\n" in fresh.stdout


def test_kernel_shutdown_during_a_run_leaves_no_process():
    import psutil

    from tests.support.kernel_client import WITHOUT_GPUS, Kernel

    own = Kernel(env=WITHOUT_GPUS)
    try:
        own.execute("%load_ext fsdp2nb")
        own.execute("%%fsdp2 --cpu 2 --no-dashboard --bg\nimport time\ntime.sleep(600)")
        pids = own.execute("import fsdp2nb\nprint(*(r.pid for r in fsdp2nb._session.pool.ranks.values()))")
        ranks = [psutil.Process(int(pid)) for pid in pids.stdout.split()]
        assert len(ranks) == 2
    finally:
        own.stop()
    gone, alive = psutil.wait_procs(ranks, timeout=60)  # a bound on the wait, not a timing check
    assert not alive, alive


def test_the_stop_button_ends_a_queued_cells_wait_not_the_run(kernel):
    flag = _flag()
    bg_id = _start_bg(kernel, "--bg --name held", _wait_for(flag) + "print('held run ended')")
    queued_id = kernel.submit("%%fsdp2\nprint('queued cell ran')")
    kernel.messages_for(queued_id, lambda ms: "waiting for In[" in _streams(ms))
    kernel.manager.interrupt_kernel()
    queued = kernel.collect(queued_id)
    assert queued.status == "error" and queued.error["ename"] == "KeyboardInterrupt"
    assert "queued cell ran" not in queued.stdout
    assert kernel.execute("print(held.state)").stdout == "running\n"
    _go(flag)
    assert kernel.execute("%fsdp2 wait held").status == "ok"
    assert "[all] held run ended\n" in _streams(kernel.messages_for(bg_id, lambda ms: "ended" in _streams(ms)))


def test_a_background_run_on_some_ranks(kernel):
    bg_id = _start_bg(kernel, "--bg --ranks 1 --name one", "print('only', rank)")
    assert kernel.execute("%fsdp2 wait one").status == "ok"
    assert _streams(kernel.messages_for(bg_id, lambda ms: "only" in _streams(ms))) == "[1] only 1\n"
    assert kernel.execute("print(one.rank_states)").stdout == "{1: 'done'}\n"
