"""Rank tracebacks read as a plain cell's: the user's frames only, in the notebook's colours."""

SHARES_THE_POOL = True  # tests/kernel/conftest.py: no test here restarts, stops or kills the pool


def test_interrupted_cell_shows_only_the_users_frames(kernel, assert_pool_usable):
    code = "%%fsdp2\nimport time\nprint('sleeping', flush=True)\ntime.sleep(120)"
    run = kernel.execute_and_interrupt(code, when_printed="sleeping")
    assert run.status == "error"
    text = run.traceback_text
    assert "KeyboardInterrupt" in text
    assert "----> 3 time.sleep(120)" in text  # the user's line, as a plain cell shows it
    for internal in ("sigint.py", "SigintGate", "rank.py", "_on_sigint", "fsdp2nb"):
        assert internal not in text, f"{internal!r} in the traceback:\n{text}"
    assert_pool_usable()


def test_an_interrupt_that_caused_another_error_shows_only_the_users_frames(kernel):
    code = ("%%fsdp2\nimport time\ntry:\n    print('sleeping', flush=True)\n    time.sleep(120)\n"
            "except KeyboardInterrupt as stop:\n    raise RuntimeError('stopped early') from stop")
    run = kernel.execute_and_interrupt(code, when_printed="sleeping")
    assert run.status == "error"
    text = run.traceback_text
    assert "time.sleep(120)" in text and "RuntimeError: stopped early" in text
    for internal in ("sigint.py", "SigintGate", "rank.py", "_on_sigint"):
        assert internal not in text, f"{internal!r} in the traceback:\n{text}"


def test_ranks_take_the_notebooks_colour_scheme(kernel):
    """The default (neutral) reads on light and dark themes; ranks once used "linux", whose
    near-white names vanish on a light theme (tests/browser/test_traceback_colors.py looks)."""
    assert kernel.execute("%%fsdp2\nprint(get_ipython().colors)").stdout == "[all] neutral\n"
    try:
        assert kernel.execute("%colors lightbg").status == "ok"
        assert kernel.execute("%%fsdp2\nprint(get_ipython().colors)").stdout == "[all] lightbg\n"
        ranked = kernel.execute("%%fsdp2\nvalues = {'a': 1}\nvalues['b']")
        assert ranked.status == "error" and "KeyError" in ranked.traceback_text
    finally:
        assert kernel.execute("%colors neutral").status == "ok"
    assert kernel.execute("%%fsdp2\nprint(get_ipython().colors)").stdout == "[all] neutral\n"
