"""Progress of long work: the rank-side hook, its throttled events, the sums the notebook shows."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from fsdp2nb import Checkpointer, export_hf, progress
from fsdp2nb.checkpoint.direct_writes import DirectWriteStream
from fsdp2nb.examples.tiny_models import make_tiny_model
from fsdp2nb.frontend.progress_bar import CellTaskBar
from fsdp2nb.widgets import markup
from fsdp2nb.widgets.model import TaskBoard
from fsdp2nb.wire.events import TaskProgress
from fsdp2nb.wire.records import ProgressUpdate
from fsdp2nb.worker.progress_sender import ProgressSender

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MiB = 2**20


@pytest.fixture
def updates():
    """Every ProgressUpdate sent while the test runs."""
    seen: list[progress.ProgressUpdate] = []
    progress.install(seen.append)
    yield seen
    progress.install(None)


def _event(rank: int, done: int, total: int = 100 * MiB, *, finished=False, items=(0, 0), error=None,
           task_id: int = 1, elapsed: float = 2.0) -> TaskProgress:
    return TaskProgress(rank=rank, cell_id=7, update=ProgressUpdate(
        task_id=task_id, kind="save", label="saving step 5", done_bytes=done, total_bytes=total,
        done_items=items[0], total_items=items[1], elapsed_s=elapsed, finished=finished, error=error))


def test_nobody_listening_costs_a_shared_task_that_does_nothing():
    assert not progress.listening()
    task = progress.start_task("save", "saving step 1", total_bytes=10)
    task.advance(5)
    task.finish()
    assert task is progress.SILENT


def test_a_task_reports_its_start_advances_and_end_once(updates):
    task = progress.start_task("load", "loading step 3", total_bytes=10, total_items=2)
    task.advance(4, 1)
    task.finish()
    task.finish()
    task.advance(6, 1)  # after the end: ignored
    assert [(u.done_bytes, u.done_items, u.finished) for u in updates] == [(0, 0, False), (4, 1, False),
                                                                         (4, 1, True)]


def test_a_failing_listener_never_reaches_the_work(updates):
    def broken(update):
        raise RuntimeError("the events channel is gone")

    progress.install(broken)
    task = progress.start_task("save", "saving step 1")
    task.advance(1)
    task.finish()  # no exception: the save goes on


def test_a_task_pickled_into_another_process_is_silent(updates):
    task = progress.start_task("save", "saving step 1")
    assert pickle.loads(pickle.dumps(task)) is progress.SILENT


def test_sender_throttles_but_always_sends_start_and_end():
    sent, now, cell = [], [0.0], [4]
    sender = ProgressSender(0, sent.append, lambda: cell[0], min_interval_s=0.25, clock=lambda: now[0])
    update = progress.ProgressUpdate(task_id=1, kind="save", label="s", done_bytes=0, total_bytes=1000,
                                     done_items=0, total_items=0, elapsed_s=0.0)
    for i in range(1000):  # a thousand buffers written within one second
        now[0] = i / 1000
        sender(progress.ProgressUpdate(**{**update.__dict__, "done_bytes": i}))
    cell[0] = None  # the cell ended before the async save did
    sender(progress.ProgressUpdate(**{**update.__dict__, "done_bytes": 1000, "finished": True}))
    assert 4 <= len(sent) <= 6
    assert sent[0].update.done_bytes == 0 and sent[-1].update.finished and sent[-1].update.done_bytes == 1000
    assert {event.cell_id for event in sent} == {4}  # the cell that started the task


def test_save_load_and_export_report_bytes_of_their_totals(updates, tmp_path):
    model = make_tiny_model("llama", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(tmp_path / "ckpt", async_save=True) as checkpointer:
        checkpointer.track(model=model, optimizer=optimizer)
        checkpointer.save(1)
        checkpointer.wait()
        checkpointer.load(1)
    export_hf(model, tmp_path / "hf")
    ends = {u.kind: u for u in updates if u.finished}
    assert set(ends) == {"save", "load", "export"} and not any(u.error for u in ends.values())
    for end in ends.values():
        assert end.total_bytes > 0 and end.done_bytes >= 0.9 * end.total_bytes, end
    assert ends["load"].done_items == ends["load"].total_items > 0
    assert ends["save"].label == "saving step 1" and ends["load"].label == "loading step 1"


def test_direct_writes_advance_by_each_buffer(updates, tmp_path):
    task = progress.start_task("save", "saving step 1", total_bytes=20 * MiB)
    stream = DirectWriteStream(tmp_path / "shard", task)
    stream.write(b"\0" * (20 * MiB))
    stream.close()
    assert updates[-1].done_bytes == 20 * MiB and len(updates) <= 4


def test_board_sums_ranks_and_ends_when_every_rank_ended():
    board = TaskBoard()
    board.observe(_event(0, 30 * MiB, items=(3, 10)))
    board.observe(_event(1, 10 * MiB, items=(1, 10)))
    task = board.latest(world_size=2)
    assert (task.done_bytes, task.total_bytes, task.done_items, task.total_items) == (40 * MiB, 200 * MiB, 1, 10)
    assert task.rate == 20 * MiB and task.seconds_left == pytest.approx(8.0) and not task.finished
    board.observe(_event(0, 100 * MiB, finished=True))
    assert not board.latest(2).finished
    board.observe(_event(1, 100 * MiB, finished=True))
    assert board.latest(2).finished and board.latest(2).fraction == 1.0


def test_an_error_on_one_rank_ends_the_task_and_names_the_rank():
    board = TaskBoard()
    board.observe(_event(0, 5))
    board.observe(_event(1, 5, finished=True, error="disk full"))
    task = board.latest(2)
    assert task.finished and "failed: rank 1: disk full" in markup.task_text(task)


def test_progress_text_has_bytes_tensors_rate_and_time_left():
    board = TaskBoard()
    board.observe(_event(0, 25 * MiB, items=(5, 20)))
    text = markup.task_text(board.latest(1))
    assert text == "saving step 5: 25 MiB of 100 MiB (25%) · 5 of 20 tensors · 12.5 MiB/s · 6 s left"
    assert 'data-finished="false"' in markup.task_html(board.latest(1))


def test_evaluation_progress_counts_batches():
    update = ProgressUpdate(task_id=1, kind="evaluate", label="evaluating", done_bytes=0, total_bytes=0,
                            done_items=3, total_items=12, elapsed_s=1.5)
    assert markup.task_text(update) == "evaluating: batch 3 of 12 (25%) · 2 batches/s · 4 s left"
    done = dataclasses.replace(update, done_items=12, finished=True, elapsed_s=6.0)
    assert markup.task_text(done) == "evaluating: done, 12 batches in 6.0 s"


def test_terminal_bar_prints_a_few_lines_for_hundreds_of_updates(capsys):
    now = [0.0]
    bar = CellTaskBar(world_size=1, clock=lambda: now[0])
    for i in range(300):
        now[0] = i * 0.05  # fifteen seconds of updates
        bar.update(_event(0, i * MiB, total=300 * MiB, elapsed=now[0] + 0.1))
    bar.update(_event(0, 300 * MiB, total=300 * MiB, finished=True, elapsed=15.0))
    lines = capsys.readouterr().out.splitlines()
    assert 2 <= len(lines) <= 4, lines
    assert lines[0].startswith("saving step 5: 0 B of 300 MiB") and "done, 300 MiB in 15.0 s" in lines[-1]
