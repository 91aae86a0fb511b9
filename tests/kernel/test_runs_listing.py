"""`%fsdp2 runs` lists this session's background runs, one line each, and `x = %fsdp2 runs` keeps
their handles."""

from __future__ import annotations

import re

from tests.support.kernel_client import WITHOUT_GPUS, Kernel


def test_runs_lists_each_background_run_with_its_state():
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        assert kernel.execute("%load_ext fsdp2nb\n%fsdp2 start --cpu 2 --no-dashboard").status == "ok"
        none_yet = kernel.execute("%fsdp2 runs")
        assert "no background runs in this session" in none_yet.result_text, none_yet.result_text
        named = kernel.execute("%%fsdp2 --bg --name first\nx = 1")
        assert kernel.execute("%fsdp2 wait first").status == "ok"
        failing = kernel.execute("%%fsdp2 --bg\nraise ValueError('on purpose')")
        kernel.execute("%fsdp2 wait")  # raises the run's error, as the blocking cell would have
        listed = kernel.execute("runs = %fsdp2 runs\nprint(repr(runs))\nprint(runs[0] is first, len(runs))")
        assert listed.status == "ok", listed.traceback_text
        lines = listed.stdout.strip().splitlines()
        first_cell, second_cell = (run.reply["content"]["execution_count"] for run in (named, failing))
        assert re.match(rf"In\[{first_cell}\] \(first\) done \d", lines[0]), lines
        assert re.match(rf"In\[{second_cell}\] failed \d", lines[1]), lines
        assert lines[2] == "True 2", lines
    finally:
        kernel.stop()
