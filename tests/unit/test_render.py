import re

from fsdp2nb.frontend.errors import RankError
from fsdp2nb.frontend.output import MERGE_WINDOW_S, StreamMerger, rank_label
from fsdp2nb.wire.records import ErrorInfo


def _merger(ranks=(0, 1, 2, 3), **kwargs):
    written = []
    merger = StreamMerger(ranks, len(ranks), lambda stream, text: written.append(text), **kwargs)
    return merger, written


def test_labels():
    assert rank_label([0, 1, 2, 3], 4) == "[all]"
    assert rank_label([1, 3], 4) == "[1,3]"
    assert rank_label([0, 1, 2, 5, 6], 8) == "[0-2,5-6]"
    assert rank_label([0], 1) == ""


def test_identical_lines_from_all_ranks_are_written_once():
    merger, written = _merger()
    for rank in range(4):
        merger.feed(rank, "stdout", "loss 1.5\n", now=0.0)
    merger.poll(now=0.0)
    assert written == ["[all] loss 1.5\n"]


def test_lines_wait_for_slow_ranks_only_within_the_window():
    merger, written = _merger()
    merger.feed(0, "stdout", "early\n", now=0.0)
    merger.poll(now=MERGE_WINDOW_S / 2)
    assert written == []
    merger.poll(now=MERGE_WINDOW_S * 2)
    assert written == ["[0] early\n"]


def test_differing_lines_are_grouped_by_text():
    merger, written = _merger()
    for rank in range(4):
        merger.feed(rank, "stdout", f"{'even' if rank % 2 == 0 else 'odd'}\n", now=0.0)
    merger.poll(now=0.0)
    assert written == ["[0,2] even\n", "[1,3] odd\n"]


def test_finished_ranks_are_not_waited_for_and_partial_lines_flush_at_the_end():
    merger, written = _merger(ranks=(0, 1))
    merger.rank_done(1)
    merger.feed(0, "stdout", "no newline", now=0.0)
    merger.poll(now=0.0)
    assert written == []
    merger.flush()
    assert written == ["[0] no newline"]


def test_output_past_the_limit_is_truncated_with_the_log_path():
    merger, written = _merger(ranks=(0, 1), log_paths={0: "/logs/rank-0.log"}, max_chars_per_rank=100)
    merger.feed(0, "stdout", "x" * 60 + "\n" + "y" * 60 + "\n", now=0.0)
    merger.feed(0, "stdout", "more and more\n", now=0.0)
    merger.flush()
    text = "".join(written)
    assert "more and more" not in text and "/logs/rank-0.log" in text and len(text) < 300


def test_rank_error_groups_identical_tracebacks_root_cause_first():
    boom = ErrorInfo("ValueError", "boom", ("tb", "ValueError: boom"))
    interrupted = ErrorInfo("KeyboardInterrupt", "", ("KeyboardInterrupt",))
    error = RankError([(2, boom), (0, interrupted), (1, interrupted)], world_size=4)
    lines = error._render_traceback_()
    assert lines[0].endswith("[2] rank 2 raised ValueError\x1b[0m")
    assert sum("raised KeyboardInterrupt" in line for line in lines) == 1
    assert "ranks 0, 1" in next(line for line in lines if "KeyboardInterrupt" in line and "raised" in line)


def test_a_rank_that_did_not_return_is_not_said_to_have_raised():
    stuck = ErrorInfo("RankStuck", "did not return after the interrupt (at In[3] line 2: time.sleep(9))", ())
    interrupted = ErrorInfo("KeyboardInterrupt", "", ("KeyboardInterrupt",))
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line)
             for line in RankError([(0, interrupted), (1, stuck)], world_size=2)._render_traceback_()]
    assert "[1] rank 1: did not return after the interrupt (at In[3] line 2: time.sleep(9))" in lines
    assert not any("raised RankStuck" in line or line.startswith("RankStuck") for line in lines)
    assert "[0] rank 0 raised KeyboardInterrupt" in lines


def test_the_cell_shows_a_crash_from_the_frame_that_crashed():
    from fsdp2nb.frontend.errors import rank_exit_error
    from fsdp2nb.wire.events import RankExited

    tail = ("step 7", "Fatal Python error: Segmentation fault", "", "Current thread 0x1 (most recent call first):",
            '  File "<ipython-input-1-x>", line 3 in crash_here', *(f'  File "f{i}.py", line {i} in g' for i in range(30)),
            "", "Extension modules: torch._C (total: 1)")
    error = rank_exit_error(RankExited(rank=1, pid=5, exit_code=None, signal_name="SIGSEGV", stderr_tail=tail))
    text = "\n".join(error.traceback)
    assert "Fatal Python error: Segmentation fault" in text and "crash_here" in text
    assert "Extension modules" not in text and len(error.traceback) <= 18
