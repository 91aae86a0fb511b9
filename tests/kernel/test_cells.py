"""%%fsdp2 cells through a real kernel: state, streaming, labels, display, errors, push/pull."""

import os
import re
import tempfile

SHARES_THE_POOL = True  # tests/kernel/conftest.py: no test here restarts, stops or kills the pool


def test_state_persists_across_cells(kernel):
    assert kernel.execute("%%fsdp2\ncounter = rank * 10").status == "ok"
    run = kernel.execute("%%fsdp2\ncounter += 1\nprint('counter', counter)")
    assert run.status == "ok"
    assert "[0] counter 1\n" in run.stdout and "[1] counter 11\n" in run.stdout


def test_namespace_and_process_group_are_ready(kernel):
    run = kernel.execute("%%fsdp2\n"
                         "import os\n"
                         "t = torch.ones(1) * (rank + 1)\n"
                         "dist.all_reduce(t)\n"
                         "print(world_size, local_rank == rank, str(device), t.item(), mesh.size(),\n"
                         "      os.environ['RANK'] == str(rank), os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'])")
    assert run.status == "ok", run.traceback_text
    assert "[all] 2 True cpu 3.0 2 True 2 127.0.0.1\n" in run.stdout


def test_identical_lines_shown_once_and_differing_lines_labelled(kernel):
    run = kernel.execute("%%fsdp2\nprint('same on every rank')\nprint('rank says', rank)")
    assert run.stdout.count("same on every rank") == 1
    assert "[all] same on every rank\n" in run.stdout
    assert "[0] rank says 0\n" in run.stdout and "[1] rank says 1\n" in run.stdout


def test_file_descriptor_output_and_stderr_are_captured(kernel):
    run = kernel.execute("%%fsdp2\nimport os, sys\nos.write(1, b'raw fd write\\n')\n"
                         "print('to stderr', file=sys.stderr)")
    assert "[all] raw fd write\n" in run.stdout
    assert "[all] to stderr\n" in run.stderr


def test_output_streams_while_the_cell_runs(kernel):
    """The cell waits for a file that the test creates only after seeing the cell's first line."""
    flag = os.path.join(tempfile.mkdtemp(), "seen")
    code = ("%%fsdp2 --ranks 0\nimport os, time\nprint('first line', flush=True)\n"
            f"deadline = time.time() + 60\nwhile not os.path.exists({flag!r}) and time.time() < deadline:\n"
            "    time.sleep(0.01)\nprint('flag seen' if os.path.exists(" + repr(flag) + ") else 'never saw flag')")

    def on_message(message):
        if message["msg_type"] == "stream" and "first line" in message["content"]["text"]:
            open(flag, "w").close()

    run = kernel.execute(code, on_message=on_message)
    assert run.stdout.index("first line") < run.stdout.index("flag seen")


def test_a_plain_cell_reaches_the_ranks_before_its_magic_runs(kernel):
    """Sent at IPython's `pre_run_cell`: a callback of that event registered later sees the ranks
    at work before IPython has compiled the cell. A cell with options waits for its magic."""
    directory = tempfile.mkdtemp()
    setup = kernel.execute(f"""
import os, time
def _wait_for_the_ranks(info):
    for word, wait_s in (('ahead_plain', 60), ('ahead_options', 1)):
        if word in info.raw_cell:
            flag, deadline = os.path.join({directory!r}, word), time.time() + wait_s
            while not os.path.exists(flag) and time.time() < deadline:
                time.sleep(0.01)
            print('ranks ran' if os.path.exists(flag) else 'ranks waited', 'before the magic')
get_ipython().events.register('pre_run_cell', _wait_for_the_ranks)
""")
    assert setup.status == "ok", setup.traceback_text
    try:
        for word, options in (("ahead_plain", ""), ("ahead_options", " --ranks 0")):
            flag = os.path.join(directory, word)
            run = kernel.execute(f"%%fsdp2{options}\nif rank == 0: open({flag!r}, 'w').close()\nprint('done')")
            assert run.status == "ok", run.traceback_text
            expected = "ranks waited" if options else "ranks ran"
            assert run.stdout.startswith(f"{expected} before the magic\n"), run.stdout
            assert "] done\n" in run.stdout
    finally:
        kernel.execute("get_ipython().events.unregister('pre_run_cell', _wait_for_the_ranks)")


def test_subset_of_ranks(kernel):
    run = kernel.execute("%%fsdp2 --ranks 1\nprint('only', rank)")
    assert run.stdout == "[1] only 1\n"


def test_variables_in_the_magic_line_are_expanded(kernel):
    run = kernel.execute("chosen = 1\n"
                         "get_ipython().run_cell_magic('fsdp2', '--ranks $chosen', 'print(\"dollar\", rank)')\n"
                         "def helper(chosen=0):\n"
                         "    get_ipython().run_line_magic('fsdp2', 'pull rank --rank {chosen}')\n"
                         "    return get_ipython().run_line_magic('fsdp2', 'pull rank --rank {chosen} --value')\n"
                         "print('pulled', helper())")
    assert run.status == "ok", run.traceback_text
    assert "[1] dollar 1\n" in run.stdout and "[0] dollar" not in run.stdout
    assert "pulled 0\n" in run.stdout  # the caller's local, as IPython expands for other magics
    braces = kernel.execute("%%fsdp2 --ranks {chosen - 1}\nprint('braces', rank)")
    assert braces.stdout == "[0] braces 0\n"


def test_last_expression_and_rich_display(kernel):
    run = kernel.execute("%%fsdp2\nfrom IPython.display import HTML, display\n"
                         "display(HTML(f'<b>rank {rank}</b>'))\nrank * 2")
    assert run.status == "ok"
    html = [d["data"]["text/html"] for d in run.displays if "text/html" in d["data"]]
    assert sorted(html) == ["<b>rank 0</b>", "<b>rank 1</b>"]
    results = [d["data"]["text/plain"] for d in run.displays if "text/html" not in d["data"]]
    assert sorted(results) == ["0", "2"]
    assert "[0]" in run.stdout and "[1]" in run.stdout


def test_semicolon_hides_the_result_and_underscore_keeps_the_last_one(kernel):
    assert kernel.execute("%%fsdp2\nrank + 40").status == "ok"
    quiet = kernel.execute("%%fsdp2\nrank + 100;  # a trailing semicolon silences the value")
    assert quiet.status == "ok" and quiet.displays == []
    run = kernel.execute("%%fsdp2\n_ + 1")
    assert sorted(d["data"]["text/plain"] for d in run.displays) == ["41", "42"]


def test_rank_tracebacks_name_the_notebook_cell(kernel):
    run = kernel.execute("%%fsdp2\nx = 1\n1 / 0")
    count = run.reply["content"]["execution_count"]
    assert f"Cell In[{count}], line 2" in run.traceback_text


def test_a_cell_run_again_unchanged_names_its_own_cell_in_tracebacks(kernel):
    cell = "%%fsdp2\ndef fail():\n    return 1 / 0\nfail()"
    for _ in range(2):  # the second run reuses the first one's code objects
        run = kernel.execute(cell)
        count = run.reply["content"]["execution_count"]
        assert f"Cell In[{count}], line 3" in run.traceback_text
        assert f"Cell In[{count}], line 2, in fail" in run.traceback_text
        assert "return 1 / 0" in run.traceback_text


def test_error_on_one_rank_fails_the_cell_with_its_traceback(kernel):
    run = kernel.execute("%%fsdp2\nif rank == 1:\n    raise ValueError('bad value on one rank')")
    assert run.status == "error"
    assert "[1] rank 1 raised ValueError" in run.traceback_text
    assert "bad value on one rank" in run.traceback_text


def test_identical_tracebacks_are_shown_once(kernel):
    run = kernel.execute("%%fsdp2\n1 / 0")
    assert run.status == "error"
    assert run.traceback_text.count("ZeroDivisionError: division by zero") == 1
    assert "[all] ranks 0, 1 raised ZeroDivisionError" in run.traceback_text


def test_syntax_error_is_reported_once_and_runs_nowhere(kernel):
    run = kernel.execute("%%fsdp2\nran_anyway = True\nx = (")
    assert run.status == "error"
    assert run.error["ename"] == "CellSyntaxError"
    assert run.traceback_text.count("was never closed") == 1
    check = kernel.execute("%%fsdp2\nprint('ran_anyway' in globals())")
    assert check.stdout == "[all] False\n"


def test_push_and_pull(kernel):
    assert kernel.execute("lr = 3e-4\nscale = {'a': 2}\ndef triple(v):\n    return 3 * v").status == "ok"
    assert kernel.execute("%fsdp2 push lr scale triple").status == "ok"
    run = kernel.execute("%%fsdp2\nprint(lr, scale['a'], triple(rank))")
    assert "[0] 0.0003 2 0\n" in run.stdout and "[1] 0.0003 2 3\n" in run.stdout
    run = kernel.execute("%%fsdp2\nfrom torch.distributed.tensor import distribute_tensor, Shard\n"
                         "full = torch.arange(10.0).reshape(5, 2)\n"
                         "sharded = distribute_tensor(full, mesh, [Shard(0)])\n"
                         "local_rows = sharded.to_local().shape[0]")
    assert run.status == "ok", run.traceback_text
    run = kernel.execute("pulled = %fsdp2 pull sharded --rank 1 --value\n"
                         "print(type(pulled).__name__, pulled.shape, pulled.sum().item())\n"
                         "rows = %fsdp2 pull local_rows --all --value\nprint(rows)")
    assert run.status == "ok", run.traceback_text
    assert "Tensor torch.Size([5, 2]) 45.0" in run.stdout
    assert "{0: 3, 1: 2}" in run.stdout


def test_failed_push_and_pull_leave_ranks_and_their_state_alone(kernel):
    assert kernel.execute("%%fsdp2\nkept = rank + 100").status == "ok"
    module_dir = tempfile.mkdtemp()  # importable in the notebook only: the ranks cannot unpickle it
    with open(os.path.join(module_dir, "notebook_only.py"), "w") as f:
        f.write("class Point:\n    pass\n")
    run = kernel.execute(f"import sys\nsys.path.insert(0, {module_dir!r})\n"
                         "import notebook_only\npoint = notebook_only.Point()\n%fsdp2 push point")
    assert run.status == "error"
    assert "ModuleNotFoundError" in run.traceback_text and "died" not in run.traceback_text
    run = kernel.execute("%%fsdp2\nfrom torch.distributed.tensor import DTensor, Shard\n"
                         "if rank == 0:\n"
                         "    half = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], run_check=False)\n"
                         "on_meta = torch.empty(3, device='meta')")
    assert run.status == "ok", run.traceback_text
    run = kernel.execute("%fsdp2 pull half")  # a gather that would wait forever for rank 1
    assert run.status == "error"
    assert "DTensor on some ranks only" in run.traceback_text
    run = kernel.execute("%fsdp2 pull on_meta")
    assert run.status == "error"
    assert "meta" in run.traceback_text and "restarted" not in run.traceback_text
    run = kernel.execute("%%fsdp2\nprint(kept)")
    assert "[0] 100\n" in run.stdout and "[1] 101\n" in run.stdout


def test_unpicklable_push_is_refused_clearly(kernel):
    run = kernel.execute("import threading\nlock = threading.Lock()\n%fsdp2 push lock")
    assert run.status == "error"
    assert "UsageError: cannot push 'lock'" in run.stderr and "pickle" in run.stderr


def test_pull_of_unknown_name_names_it(kernel):
    run = kernel.execute("%fsdp2 pull no_such_name")
    assert run.status == "error"
    assert "no_such_name" in run.traceback_text


def test_large_output_is_truncated_with_the_log_path(kernel):
    run = kernel.execute("%%fsdp2\nimport sys\nline = 'x' * 99 + '\\n'\n"
                         "for _ in range(100_000):\n    sys.stdout.write(line)\nprint('done', rank)", timeout=300)
    assert run.status == "ok"
    assert len(run.stdout) < 1_000_000
    logs = re.findall(r"the full output is in (\S+\.log)", run.stdout)
    assert len(logs) == 2
    for path in logs:
        assert os.path.getsize(path) >= 10_000_000


def test_interrupt_raises_keyboard_interrupt_on_every_rank(kernel):
    code = ("%%fsdp2\nimport time\nprint('sleeping', flush=True)\ntry:\n    time.sleep(120)\n"
            "except KeyboardInterrupt:\n    print('interrupted on', rank, flush=True)\n    raise")
    run = kernel.execute_and_interrupt(code, when_printed="sleeping")
    assert run.status == "error"
    assert "[0] interrupted on 0" in run.stdout and "[1] interrupted on 1" in run.stdout
    assert "KeyboardInterrupt" in run.traceback_text
    assert kernel.execute("%%fsdp2\nprint('still here')").stdout == "[all] still here\n"


def test_matplotlib_figure_from_rank_0_is_shown_labelled(kernel):
    run = kernel.execute("%%fsdp2 --ranks 0\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.title('r0')",
                         timeout=120)
    assert run.status == "ok", run.traceback_text
    images = [d for d in run.displays if "image/png" in d["data"]]
    assert len(images) == 1
    assert "[0]" in run.stdout


def test_pull_from_a_rank_that_does_not_exist_says_so(kernel):
    run = kernel.execute("%fsdp2 pull rank --rank -1")
    assert run.status == "error"
    assert "UsageError: --rank -1 does not exist: the pool has ranks 0-1" in run.stderr


def test_output_of_a_rank_thread_between_cells_comes_with_the_next_cell(kernel):
    run = kernel.execute("%%fsdp2\nimport threading, time\nfrom IPython.display import HTML, display\n"
                         "def later():\n"
                         "    time.sleep(0.3)\n"
                         "    print('late', rank, flush=True)\n"
                         "    if rank == 0:\n"
                         "        display(HTML('<b>from a thread</b>'))\n"
                         "threading.Thread(target=later).start()")
    assert run.status == "ok" and "late" not in run.stdout
    assert kernel.execute("import time\ntime.sleep(1.5)").status == "ok"
    run = kernel.execute("%%fsdp2\nprint('cell')")
    assert "[0] (outside a cell) late 0\n" in run.stdout and "[1] (outside a cell) late 1\n" in run.stdout
    assert run.stdout.index("outside a cell") < run.stdout.index("[all] cell")
    assert [d["data"]["text/html"] for d in run.displays] == ["<b>from a thread</b>"]


def test_rank_snapshots_reach_listeners_while_a_cell_runs(kernel):
    # While a cell runs, the thread waiting for it reads the ranks' events: it must deliver
    # snapshots too, or a live memory view would freeze for as long as training runs.
    setup = ("import time, fsdp2nb\n"
             "_seen = []\n"
             "fsdp2nb._session.pool.snapshot_listeners.append(lambda s: _seen.append((time.monotonic(), s.rank)))")
    assert kernel.execute(setup).status == "ok"
    run = kernel.execute("_began = time.monotonic()\n"
                         "get_ipython().run_cell_magic('fsdp2', '', 'import time\\ntime.sleep(2)')\n"
                         "_ended = time.monotonic()\n"
                         "print(sorted({rank for at, rank in _seen if _began < at < _ended}))")
    assert run.status == "ok", run.traceback_text
    assert run.stdout.strip().splitlines()[-1] == "[0, 1]"
