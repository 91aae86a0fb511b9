"""`%%fsdp2 --profile`, `fsdp2nb.profile()`, `%fsdp2 profile` and `%fsdp2 stacks` through a real
kernel on 3 CPU ranks: the straggler and the others' waiting, rows whose parts add up, one merged
trace on one clock, and stacks taken while a cell runs on.

A cell held in place (for `%fsdp2 stacks`) waits for a flag file the test creates once it has seen
what it must, so nothing here depends on timing."""

import json
import os
import re
import tempfile
from collections import defaultdict

import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel, kernels_with_fsdp2nb

SLEEP_S = 0.15
NUM_COLLECTIVES = 4
STRAGGLER_CELL = f"""%%fsdp2 --profile
import time
x = torch.ones(1000)
for _ in range({NUM_COLLECTIVES}):
    if rank == 1:
        time.sleep({SLEEP_S})
    dist.all_reduce(x)
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    run = k.execute("%fsdp2 start --cpu 3 --no-dashboard")
    assert run.status == "ok", run.traceback_text
    yield k
    k.stop()


@pytest.fixture(scope="module")
def straggler_run(kernel):
    run = kernel.execute(STRAGGLER_CELL)
    assert run.status == "ok", run.traceback_text
    assert kernel.execute("prof = %fsdp2 profile").status == "ok"
    return run


def _profile_view(kernel, run) -> str:
    """The profile view that replaced the cell's placeholder (the ranks send it after their replies)."""
    (display_id,) = run.display_ids
    return kernel.display_update(run, display_id)["data"].get("text/html", "")


def _values(kernel, expression: str):
    run = kernel.execute(f"import json as _json\nprint(_json.dumps({expression}))")
    assert run.status == "ok", run.traceback_text
    return json.loads(run.stdout)


def test_the_rank_that_sleeps_is_the_straggler_and_the_others_wait_for_it(kernel, straggler_run):
    shown = _profile_view(kernel, straggler_run)
    assert "straggler: rank 1" in shown and "<svg" in shown, shown[:500]
    assert _values(kernel, "prof.straggler") == 1
    waiting = _values(kernel, "{row.rank: row.waiting_s for row in prof.ranks}")
    slept = SLEEP_S * NUM_COLLECTIVES
    assert waiting["0"] >= 0.9 * slept and waiting["2"] >= 0.9 * slept, waiting
    assert waiting["1"] < 0.5 * slept, waiting


def test_each_rows_parts_add_up_to_its_wall_time(kernel, straggler_run):
    rows = _values(kernel, "[(r.wall_s, r.compute_s, r.communication_s, r.idle_s, r.waiting_s) for r in prof.ranks]")
    assert len(rows) == 3
    for wall, compute, communication, idle, waiting in rows:
        assert wall >= SLEEP_S * NUM_COLLECTIVES
        assert compute + communication + idle == pytest.approx(wall, abs=1e-6)
        assert min(compute, communication, idle) >= 0 and waiting <= communication + 1e-9


def test_the_merged_trace_has_a_process_per_rank_and_collectives_end_together(kernel, straggler_run):
    path = _values(kernel, "prof.trace_path")
    with open(path) as file:
        trace = json.load(file)
    processes = {event["pid"] for event in trace["traceEvents"] if event.get("name") == "process_name"}
    assert processes == {0, 1, 2}
    ends = defaultdict(dict)  # (name, n-th) -> rank -> end (us)
    for rank in processes:
        collectives = sorted((e for e in trace["traceEvents"] if e["pid"] == rank and e.get("cat") == "collective"),
                             key=lambda e: e["ts"])
        seen = defaultdict(int)
        for event in collectives:
            ends[(event["name"], seen[event["name"]])][rank] = event["ts"] + event["dur"]
            seen[event["name"]] += 1
    all_reduces = [by_rank for (name, _), by_rank in ends.items() if name.endswith("all_reduce")]
    assert len(all_reduces) >= NUM_COLLECTIVES and all(len(by_rank) == 3 for by_rank in all_reduces)
    spreads = sorted(max(by_rank.values()) - min(by_rank.values()) for by_rank in all_reduces)
    # A wrong clock offset would move every end; a rank descheduled on a busy host just after one
    # collective moves that one only, and by far less than the straggler's sleep moves the starts.
    # Three ranks on two cores wake from a collective a scheduler tick or two apart under load.
    assert spreads[len(spreads) // 2] < 10_000, spreads  # the median within 10 ms
    assert spreads[-1] < SLEEP_S * 1e6 / 3, spreads


def test_top_ops_name_the_collective(kernel, straggler_run):
    names = _values(kernel, "[op.name for op in prof.top_ops]")
    assert 0 < len(names) <= 10 and any(name.endswith("all_reduce") for name in names), names


def test_a_cell_without_profile_runs_without_the_profiler(kernel):
    plain = kernel.execute("%%fsdp2\nprint(torch.autograd._profiler_enabled())")
    assert plain.stdout == "[all] False\n", plain.stdout + plain.traceback_text
    profiled = kernel.execute("%%fsdp2 --profile\nprint(torch.autograd._profiler_enabled())")
    assert profiled.stdout == "[all] True\n", profiled.stdout + profiled.traceback_text


def test_a_failing_cell_still_shows_what_ran(kernel):
    run = kernel.execute("%%fsdp2 --profile\ntorch.ones(64, 64) @ torch.ones(64, 64)\nraise ValueError('late')")
    assert run.status == "error" and "late" in run.traceback_text
    shown = _profile_view(kernel, run)
    assert "aten::mm" in shown, shown[:500]


def test_the_cell_ends_with_a_placeholder_that_the_profile_replaces(kernel):
    run = kernel.execute("%%fsdp2 --profile\nsummed = torch.ones(32, 32).cumsum(0)")
    assert run.status == "ok", run.traceback_text
    (placeholder,) = [d for d in run.displays if d.get("transient", {}).get("display_id")]
    assert "fsdp2nb-profile-pending" in placeholder["data"]["text/html"], placeholder
    assert kernel.execute("right_after = %fsdp2 profile").status == "ok"  # waits for the ranks' profiles
    assert sorted(_values(kernel, "[row.rank for row in right_after.ranks]")) == [0, 1, 2]
    assert "aten::cumsum" in _values(kernel, "[op.name for op in right_after.top_ops]")
    shown = _profile_view(kernel, run)
    assert "fsdp2nb-profile-pending" not in shown and "<svg" in shown and "aten::cumsum" in shown, shown[:500]


def test_a_deferred_profile_shows_nothing_under_the_next_cell(kernel):
    profiled = kernel.execute("%%fsdp2 --profile\ntorch.ones(16).cumprod(0)")
    later = kernel.execute("%%fsdp2\nprint('next')")
    assert later.stdout == "[all] next\n", later.stdout + later.traceback_text
    assert "aten::cumprod" in _profile_view(kernel, profiled)
    assert not any(m["msg_type"] in ("display_data", "update_display_data") for m in later.messages), later.messages


def test_a_stopped_cell_still_shows_what_ran(kernel):
    code = ("%%fsdp2 --profile\nimport time\ntorch.ones(8).cumsum(0)\nprint('looping', flush=True)\n"
            "while True:\n    time.sleep(0.01)")
    run = kernel.execute_and_interrupt(code, when_printed="looping")
    assert run.status == "error" and "KeyboardInterrupt" in run.traceback_text, run.traceback_text
    shown = _profile_view(kernel, run)
    assert "aten::cumsum" in shown and "<svg" in shown, shown[:500]


def test_a_rank_that_dies_mid_profile_is_named_in_the_view():
    with kernels_with_fsdp2nb(WITHOUT_GPUS) as start:
        kernel = start()
        assert kernel.execute("%fsdp2 start --cpu 2 --no-dashboard").status == "ok"
        # rank 1 exits in the cell, so it never sends its profile: the view must not wait for it
        run = kernel.execute("%%fsdp2 --profile\nimport os\ntorch.ones(8).cumsum(0)\nif rank == 1:\n    os._exit(3)")
        assert run.status == "error" and "exit code 3" in run.traceback_text, run.traceback_text
        shown = _profile_view(kernel, run)
    missing = re.search(r"the profile is missing for ranks? ([0-9, ]+):", shown)
    assert missing and "1" in missing.group(1).split(", "), shown[:500]


def test_profile_block_profiles_only_the_block(kernel):
    run = kernel.execute("%%fsdp2\nimport fsdp2nb\nfor step in range(4):\n    torch.ones(8).sum()\n"
                         "    if step == 2:\n        with fsdp2nb.profile():\n            torch.ones(8).cumsum(0)\n")
    assert run.status == "ok", run.traceback_text
    assert any("fsdp2nb-profile" in d["data"].get("text/html", "") for d in run.displays)
    assert kernel.execute("block = %fsdp2 profile").status == "ok"
    names = _values(kernel, "[op.name for op in block.top_ops]")
    assert "aten::cumsum" in names and "aten::sum" not in names, names


def test_profile_with_bg_is_refused_in_one_line(kernel):
    run = kernel.execute("%%fsdp2 --profile --bg\nrefused_run = 1")
    usage = [text for text in run.stderr.splitlines() if text.startswith("UsageError: ")]
    assert run.status == "error" and len(usage) == 1 and "--profile" in usage[0], run.stderr
    assert kernel.execute("%%fsdp2\nprint('refused_run' in dir())").stdout == "[all] False\n"


def test_stacks_show_every_rank_at_its_cell_line_while_the_cell_runs_on(kernel):
    flag = os.path.join(tempfile.mkdtemp(), "go")
    body = (f"import os, time\ny = torch.ones(1)\nif rank == 1:\n"
            f"    while not os.path.exists({flag!r}):\n        time.sleep(0.01)\n"
            "dist.all_reduce(y)\n")
    started = kernel.execute(f"%%fsdp2 --bg --name held\n{body}")
    assert started.status == "ok", started.traceback_text
    try:
        for _ in range(200):  # until rank 0 is in the all_reduce and rank 1 in its loop
            stacks = kernel.execute("%fsdp2 stacks").stdout
            if "dist.all_reduce(y)" in _rank_lines(stacks, 0) and "time.sleep(0.01)" in _rank_lines(stacks, 1):
                break
        else:
            pytest.fail(f"the stacks never showed both ranks at their lines:\n{stacks}")
    finally:
        open(flag, "w").close()
    assert "] line 6: dist.all_reduce(y)" in _rank_lines(stacks, 0), stacks
    assert "] line 5: time.sleep(0.01)" in _rank_lines(stacks, 1), stacks
    assert "(runs cells)" in _rank_lines(stacks, 2)
    waited = kernel.execute("%fsdp2 wait held")
    assert waited.status == "ok", waited.traceback_text


def _rank_lines(text: str, rank: int) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith(f"[{rank}]"))


def test_clock_round_trips_put_ranks_on_the_kernels_clock_within_their_bound(kernel):
    """Ranks on the kernel's host share its clock: each measured offset is within its bound."""
    setup = kernel.execute("_magics = get_ipython().find_cell_magic('fsdp2').__self__\n"
                           "from fsdp2nb.frontend.rank_clocks import estimate_offsets\n"
                           "_offsets = estimate_offsets(_magics.session.pool, _magics.session.requests.next_cell_id, "
                           "_magics._profiles)")
    assert setup.status == "ok", setup.traceback_text
    offsets = _values(kernel, "{rank: pair for rank, pair in _offsets.items()}")
    assert sorted(offsets) == ["0", "1", "2"]
    for offset_ns, error_ns in offsets.values():
        assert 0 <= error_ns < 1_000_000_000 and abs(offset_ns) <= error_ns + 1_000_000, offsets


def test_a_background_runs_profile_waits_for_profile_and_is_not_shown_under_a_later_cell(kernel):
    started = kernel.execute("%%fsdp2 --bg --name profiled_run\nimport fsdp2nb\n"
                             "with fsdp2nb.profile():\n    torch.ones(8).cumprod(0)\n")
    assert started.status == "ok", started.traceback_text
    assert kernel.execute("%fsdp2 wait profiled_run").status == "ok"
    later = kernel.execute("%%fsdp2\nprint('later')")
    assert later.stdout == "[all] later\n", later.stdout + later.traceback_text
    assert not any("fsdp2nb-profile" in d["data"].get("text/html", "") for d in later.displays)
    assert kernel.execute("from_run = %fsdp2 profile").status == "ok"
    assert "aten::cumprod" in _values(kernel, "[op.name for op in from_run.top_ops]")
