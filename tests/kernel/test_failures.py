"""Failures a pool must survive: a rank that raises mid-collective, a dead rank, a stuck rank."""



def test_rank_raising_while_others_wait_in_a_collective(kernel):
    run = kernel.execute("%%fsdp2\nkept = 'before'\nif rank == 1:\n    raise RuntimeError('root cause on rank 1')\n"
                         "dist.barrier()", timeout=120)
    assert run.status == "error"
    text = run.traceback_text
    assert text.index("root cause on rank 1") < text.find("KeyboardInterrupt") or "KeyboardInterrupt" not in text
    assert "[1] rank 1 raised RuntimeError" in text.splitlines()[0]
    assert "re-formed in place" in text and "restarted" not in text
    after = kernel.execute("%%fsdp2\nprint('kept' in globals(), world_size)")
    assert after.status == "ok" and after.stdout == "[all] True 2\n"


def test_dead_rank_ends_the_cell_with_its_signal_and_last_lines(kernel, assert_pool_usable):
    run = kernel.execute("%%fsdp2\nimport os, sys, time\nif rank == 1:\n"
                         "    print('last words', file=sys.stderr, flush=True)\n    os.kill(os.getpid(), 9)\n"
                         "time.sleep(60)", timeout=120)
    assert run.status == "error"
    text = run.traceback_text
    assert "rank 1" in text and "SIGKILL" in text and "last words" in text
    assert_pool_usable()


def test_os_exit_reports_the_exit_code(kernel):
    run = kernel.execute("%%fsdp2 --ranks 0\nimport os\nos._exit(7)", timeout=120)
    assert run.status == "error" and "exit code 7" in run.traceback_text


def test_segfault_reports_the_signal(kernel, assert_pool_usable):
    run = kernel.execute("%%fsdp2 --ranks 1\nimport ctypes\nctypes.string_at(0)", timeout=120)
    assert run.status == "error" and "rank 1" in run.traceback_text and "SIGSEGV" in run.traceback_text
    assert_pool_usable()


def test_rank_ignoring_the_interrupt_gets_the_pool_restarted(kernel, assert_pool_usable):
    code = ("%%fsdp2\nimport signal, time\nif rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "print('waiting', flush=True)\ntime.sleep(120)")
    run = kernel.execute_and_interrupt(code, when_printed="waiting")
    assert run.status == "error"
    assert "state was lost" in run.traceback_text and "rank(s) 1" in run.traceback_text
    # Rank 1 ignored the interrupt: it is said to be stuck at its line, not to have raised.
    assert "[1] rank 1: did not return after the interrupt (at In[" in run.traceback_text
    assert "time.sleep(120)" in run.traceback_text
    assert "[1] rank 1 raised KeyboardInterrupt" not in run.traceback_text
    assert_pool_usable()
