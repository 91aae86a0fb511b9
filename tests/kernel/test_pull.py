"""`%fsdp2 pull` mirrors push: it defines the names in the notebook and returns None; with
`--value` it returns the value and defines nothing."""

SHARES_THE_POOL = True  # tests/kernel/conftest.py: no test here restarts, stops or kills the pool


def test_pull_defines_the_names(kernel):
    assert kernel.execute("%%fsdp2\nloss = 10 + rank\nstep = 7").status == "ok"
    run = kernel.execute("loss = step = None\n%fsdp2 pull loss step")
    assert run.status == "ok", run.traceback_text
    assert run.displays == [] and run.stdout == ""  # nothing shown, as after a push
    assert kernel.execute("print(loss, step)").stdout == "10 7\n"
    assert kernel.execute("%fsdp2 pull loss --rank 1\nprint(loss)").stdout == "11\n"
    assert kernel.execute("%fsdp2 pull loss --all").status == "ok"
    assert kernel.execute("print(loss)").stdout == "{0: 10, 1: 11}\n"
    run = kernel.execute("y = %fsdp2 pull step\nprint(y, step)")  # assigned without --value: still defines
    assert run.stdout == "None 7\n", run.traceback_text


def test_pull_value_returns_it_and_defines_nothing(kernel):
    assert kernel.execute("%%fsdp2\nremote = 20 + rank\nother = 'o'").status == "ok"
    run = kernel.execute("remote = 'notebook'\ny = %fsdp2 pull remote --rank 1 --value\n"
                         "both = %fsdp2 pull remote other --value\nprint(y, both, remote)")
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "21 (20, 'o') notebook\n"
    run = kernel.execute("%fsdp2 pull remote --all --value")  # the last line: shown as the cell's result
    assert run.status == "ok" and "{0: 20, 1: 21}" in str(run.displays), run.displays


def test_a_failed_pull_defines_no_name(kernel):
    assert kernel.execute("%%fsdp2\nfound = 1").status == "ok"
    run = kernel.execute("found = 'kept'\n%fsdp2 pull found not_on_the_ranks")
    assert run.status == "error" and "not_on_the_ranks" in run.traceback_text
    assert kernel.execute("print(found)").stdout == "kept\n"
    run = kernel.execute("%fsdp2 pull found 2nd")
    assert run.status == "error" and "UsageError: cannot pull '2nd': it is not a Python name" in run.stderr
