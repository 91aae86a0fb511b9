"""The dashboard's model and widget tree, fed synthetic snapshots: no processes, no kernel."""

from __future__ import annotations

import re

import pytest

from fsdp2nb.widgets import markup
from fsdp2nb.widgets.dashboard import ActionRefused, DashboardView
from fsdp2nb.widgets.model import MAX_HISTORY_POINTS, DashboardModel, MetricsHistory, PoolFacts
from fsdp2nb.wire.events import RankSnapshot, TaskProgress
from fsdp2nb.wire.records import (
    CheckpointEntry,
    CheckpointStatus,
    CheckpointView,
    MetricPoint,
    ProgressUpdate,
)

GiB = 2**30


def _gpu(rank: int, allocated: float, t: float = 1000.0, **extra) -> RankSnapshot:
    return RankSnapshot(rank=rank, time=t, busy=False, rss_bytes=3 * GiB, cpu_percent=10.0,
                        device_allocated_bytes=int(allocated * GiB), device_reserved_bytes=int(allocated * GiB),
                        device_peak_bytes=int(allocated * GiB), device_total_bytes=80 * GiB, **extra)


def _view(latest: int | None, served: int = 0, saving: int | None = None, steps=(2, 4),
          committed: int | None = None, error: str | None = None) -> CheckpointView:
    """`served` > 0: request `served` saves step `saving`, or `latest` once `committed` (by
    default: when no save is in flight)."""
    entries = tuple(CheckpointEntry(step=s, path=f"/ckpt/run1/step-{s:06d}", wall_time=1.7e9, size_bytes=5 * 2**20,
                                    world_size=2, valid=True) for s in steps)
    status = CheckpointStatus(directory="/ckpt/run1", latest_step=latest, saving_step=saving, last_error=None,
                              entries=entries)
    committed = (served if saving is None else 0) if committed is None else committed
    return CheckpointView(status=status, requests_served=served,
                          request_step=saving if saving is not None else latest if served else None,
                          requests_committed=committed, request_error=error)


def _model(world_size: int = 2, **facts) -> DashboardModel:
    model = DashboardModel()
    model.set_facts(PoolFacts(state="ready", world_size=world_size, devices={0: "cuda:0", 1: "cuda:1"},
                              pids={0: 11, 1: 12}, **facts))
    return model


class RecordingActions:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def action(*args):
            self.calls.append((name, *args))
            if name == "export" and not args[0]:
                raise ActionRefused("give a path to export to")
            return f"{name} done"
        return action


def test_memory_bar_turns_red_past_90_percent():
    model = _model()
    model.observe(_gpu(0, allocated=40))
    model.observe(_gpu(1, allocated=75))
    low, high = model.rows()
    assert not low.memory.warning and high.memory.warning
    assert "#dc2626" in markup.memory_bar(high.memory) and "#dc2626" not in markup.memory_bar(low.memory)
    assert markup.memory_text(low.memory).startswith("40 GiB / 80 GiB alloc")


def test_cpu_rank_shows_rss_and_tracked_bytes_against_host_memory():
    model = _model(world_size=1, host_total_bytes=16 * GiB)
    model.observe(RankSnapshot(rank=0, time=1.0, busy=False, rss_bytes=2 * GiB, cpu_percent=0.0,
                               rss_peak_bytes=3 * GiB, param_bytes=2**20, grad_bytes=2**20, optimizer_bytes=2**21))
    (row,) = model.rows()
    assert row.memory.kind == "cpu" and row.memory.total == 16 * GiB and row.memory.peak == 3 * GiB
    assert markup.tracked_text(row.memory) == "params 1 MiB · grads 1 MiB · optimizer 2 MiB · other 2 GiB"
    # Read when a cell ends, not live: the row says so on hover.
    assert ('title="as the last cell on this rank left them"><span style="white-space:nowrap">'
            '<span style="color:#2563eb">■</span> params 1 MiB') \
        in markup.rank_row_html(row)


def test_the_bar_splits_used_memory_into_the_tracked_models_parts_and_the_rest():
    model = _model(world_size=2)
    model.observe(_gpu(0, allocated=40))
    model.observe(RankSnapshot(rank=1, time=1.0, busy=False, rss_bytes=GiB, cpu_percent=0.0, device_allocated_bytes=40 * GiB,
                               device_reserved_bytes=48 * GiB, device_total_bytes=80 * GiB,
                               param_bytes=10 * GiB, grad_bytes=10 * GiB, optimizer_bytes=16 * GiB))
    plain, split = model.rows()
    assert split.memory.parts == (("params", 10 * GiB), ("grads", 10 * GiB), ("optimizer", 16 * GiB), ("other", 4 * GiB))
    bar = markup.memory_bar(split.memory, width=160)
    widths = {part: [int(w) for w in re.findall(rf'class="fsdp2nb-used" data-part="{part}" x="\d+" y="0" width="(\d+)"', bar)]
              for part in ("params", "grads", "optimizer", "other")}
    assert widths == {"params": [20], "grads": [20], "optimizer": [32], "other": [8]}  # of 80 GiB in 160 px
    strip = [int(w) for w in re.findall(r'class="fsdp2nb-part" data-part="\w+" x="\d+" y="14" width="(\d+)"', bar)]
    assert strip == [40, 40, 64, 16]  # shares of the 40 GiB used, the strip as wide as the bar
    assert "<title>the tracked model's parameters: 10 GiB</title>" in bar
    assert "fsdp2nb-part" not in markup.memory_bar(plain.memory)  # nothing tracked: one used bar
    assert "other 4 GiB" in markup.text_tables(model.rows(), None, "pool")


def test_dead_and_busy_ranks_are_told_apart():
    model = _model(deaths={1: "killed by SIGKILL"}, busy=frozenset({0}))
    model.set_facts(PoolFacts(state="broken", world_size=2, deaths={1: "killed by SIGKILL"}, busy=frozenset({0})),
                    now=100.0)
    busy, dead = model.rows(now=112.0)
    assert dead.state == "dead" and dead.state_text == "dead: killed by SIGKILL"
    assert busy.state == "busy"


def test_a_replaced_pool_says_which_rank_died():
    model = _model()
    model.set_facts(PoolFacts(state="broken", world_size=2, deaths={1: "killed by SIGSEGV"}))
    assert model.rows()[1].state_text == "dead: killed by SIGSEGV"
    model.set_facts(PoolFacts(state="ready", world_size=2))
    view = DashboardView(model, RecordingActions())
    view.refresh("ready")
    assert "rank 1 died (killed by SIGSEGV): the pool was replaced" in view.message.value


def test_busy_rank_shows_how_long_it_has_been_busy():
    model = _model()
    model.set_facts(PoolFacts(state="ready", world_size=2, busy=frozenset({0, 1})), now=100.0)
    assert model.rows(now=175.0)[0].state_text == "busy 1 min 15 s"


def test_memory_history_is_bounded_and_shows_a_leak():
    model = _model(world_size=1)
    for i in range(MAX_HISTORY_POINTS + 50):
        model.observe(_gpu(0, allocated=1 + i / 100, t=1000.0 + i * 0.01))
    (row,) = model.rows(now=1000.0 + MAX_HISTORY_POINTS * 0.01)
    assert len(row.history) == MAX_HISTORY_POINTS
    assert row.history[-1] > row.history[0]
    assert "<polyline" in markup.sparkline(row.history)


def test_metric_history_keeps_a_flat_memory():
    history = MetricsHistory(max_points=100)
    for step in range(10_000):
        history.add(0, (MetricPoint(step=step, time=0.0, values={"loss": 1.0 / (step + 1)}),))
    points = history.points(0)
    assert len(points) <= 100 and points[-1].step == 9_999 and points[0].step == 0


def test_save_request_is_followed_to_its_outcome():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    model.save_requested(1)
    assert "requested" in model.save_text
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=1, saving=7)))
    assert model.save_text == "saving step 7 ..."
    model.observe(_gpu(0, 1, checkpoint=_view(latest=7, served=1, steps=(2, 4, 7))))
    assert model.save_text == "saved step 7"


def test_a_save_of_the_step_latest_already_names_is_followed_by_its_request():
    """A notebook run again into the same directory: LATEST names step 4 before and after."""
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=1)))
    model.save_requested(2)
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=2, saving=4)))
    assert model.save_text == "saving step 4 ..."
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=2, committed=2)))
    assert model.save_text == "saved step 4" and not model.save_pending


def test_a_served_request_not_yet_saving_is_not_called_saved():
    """Served, its save not started yet (the ranks wait for an earlier one): LATEST is no sign."""
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    model.save_requested(1)
    model.observe(_gpu(0, 1, checkpoint=_view(latest=6, served=1, committed=0, steps=(2, 4, 6))))
    assert model.save_pending and model.save_text.startswith("saving step 6")


def test_a_failed_request_says_why_and_an_older_failure_does_not():
    model = _model()
    model.save_requested(1)
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=1, saving=7, committed=0, error="disk full")))
    assert model.save_text == "save failed: disk full" and not model.save_pending
    model.save_requested(2)
    model.observe(_gpu(0, 1, checkpoint=_view(latest=8, served=2, steps=(2, 4, 8))))
    assert model.save_text == "saved step 8"


def test_the_same_outcome_twice_is_shown_twice():
    """Saved step 4, then the action's own line, then saved step 4 again (a refresh may miss
    the texts between): the panel ends on the outcome, not on the action's line."""
    model = _model()
    view = DashboardView(model, RecordingActions())
    model.save_requested(1)
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=1)))
    view.refresh("ready")
    assert "saved step 4" in view.message.value
    view.message.value = "saved; the list shows the new step"  # what a click's action returned
    model.save_requested(2, "saved; the list shows the new step")
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=2)))
    view.refresh("ready")
    assert "saved step 4" in view.message.value


def _save_progress(rank: int, done_mib: int, finished: bool = False) -> TaskProgress:
    return TaskProgress(rank=rank, cell_id=3, update=ProgressUpdate(
        task_id=2, kind="save", label="saving step 7", done_bytes=done_mib * 2**20, total_bytes=40 * 2**20,
        done_items=0, total_items=0, elapsed_s=2.5 if finished else 1.0, finished=finished))


def test_save_line_says_bytes_written_then_how_long_it_took():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    model.save_requested(1)
    for rank in (0, 1):
        model.observe(_save_progress(rank, 10))
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, served=1, saving=7)))
    assert model.save_text == "saving step 7: 20.0 MiB of 80.0 MiB"
    model.observe(_gpu(0, 1, checkpoint=_view(latest=7, served=1, steps=(2, 4, 7))))
    assert model.save_pending  # committed, but the ranks' last progress events are still on their way
    for rank in (0, 1):
        model.observe(_save_progress(rank, 40, finished=True))
    model.observe(_gpu(0, 1, checkpoint=_view(latest=7, served=1, steps=(2, 4, 7))))
    assert model.save_text == "saved step 7 in 2.5 s" and not model.save_pending


def test_dashboard_shows_the_newest_task_as_a_bar():
    model = _model()
    view = DashboardView(model, RecordingActions())
    view.refresh("ready")
    assert view.progress.value == ""
    model.observe(_save_progress(0, 10))
    view.refresh("ready")
    assert 'data-kind="save"' in view.progress.value and "saving step 7: 10 MiB of 40 MiB" in view.progress.value


def test_deleting_latest_asks_twice_naming_the_step_a_resume_would_load():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    actions = RecordingActions()
    view = DashboardView(model, actions)
    view.refresh("ready")
    view.steps.value = 4
    view.delete_button.click()
    assert "Delete step 4?" in view.question.value
    view.confirm.children[1].click()  # Yes, once
    assert actions.calls == [] and view.confirm.layout.display == "flex"
    assert "Step 4 is LATEST: a resume would then load step 2, the previous one" in view.question.value
    view.confirm.children[1].click()  # Yes, twice
    assert actions.calls == [("delete", 4, True)] and view.confirm.layout.display == "none"


def test_deleting_latest_stops_at_a_cancel_of_the_second_question():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4, steps=(4,))))
    actions = RecordingActions()
    view = DashboardView(model, actions)
    view.refresh("ready")
    view.steps.value = 4
    view.delete_button.click()
    view.confirm.children[1].click()
    assert "no complete checkpoint would be left to resume from" in view.question.value
    view.confirm.children[2].click()  # Cancel
    assert actions.calls == [] and view.confirm.layout.display == "none"


def test_a_request_the_cell_never_served_is_saved_at_its_end():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    model.save_requested(3)
    model.cell_ended_with_request()
    assert model.save_pending and "saving at the last step" in model.save_text
    model.observe(_gpu(0, 1, checkpoint=_view(latest=9, served=3, steps=(2, 4, 9))))
    assert model.save_text == "saved step 9" and not model.save_pending


def test_the_cell_end_leaves_a_save_in_flight_or_a_trainers_alone():
    """'the cell ended before its next maybe_save' only where a checkpointer is left to serve it:
    not once a snapshot said it was served, nor where a Trainer alone serves requests (its
    snapshot saying 'saved' may come after the cell ended)."""
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    model.save_requested(3)
    model.observe(_gpu(1, 1, checkpoint=_view(latest=4, served=3, saving=6)))
    model.cell_ended_with_request()
    assert model.save_text == "saving step 6 ..."
    trainer = _model()
    trainer.observe(_gpu(0, 1.0, trainer_checkpoints=_trainer_view()))
    trainer.save_requested(1, "save requested: Trainer saves at the end of its next step")
    trainer.cell_ended_with_request()
    assert trainer.save_text == "save requested: Trainer saves at the end of its next step"
    trainer.observe(_gpu(0, 1.0, trainer_checkpoints=_trainer_view(served=1, committed=1)))
    assert trainer.save_text == "saved step 3" and not trainer.save_pending


def test_view_lists_steps_newest_first_with_latest_marked():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    view = DashboardView(model, RecordingActions())
    view.refresh("cpu 2 · ready")
    labels = [label for label, _ in view.steps.options]
    assert [step for _, step in view.steps.options] == [4, 2]
    assert labels[0].endswith("LATEST") and "LATEST" not in labels[1]
    assert "/ckpt/run1" in view.checkpoint_header.value


def test_view_sends_nothing_when_nothing_changed():
    model = _model()
    model.observe(_gpu(0, 1))
    view = DashboardView(model, RecordingActions())
    view.refresh("ready")
    changes = []
    for widget in view._all_widgets():
        widget.observe(lambda change: changes.append(change["name"]), names="value")
    view.refresh("ready")
    assert changes == []
    model.observe(_gpu(0, 2))
    view.refresh("ready")
    assert changes == ["value"]  # rank 0's row only


def test_every_button_calls_its_action():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    actions = RecordingActions()
    view = DashboardView(model, actions)
    view.refresh("ready")
    view.steps.value = 2
    view.export_path.value = "/tmp/export"
    for button in (view.stop_button, view.reset_peak_button, view.save_button, view.export_button):
        button.click()
    for button in (view.load_button, view.delete_button, view.restart_button):
        button.click()
        assert view.confirm.layout.display == "flex"
        view.confirm.children[1].click()  # Yes
        assert view.confirm.layout.display == "none"
    assert actions.calls == [("stop",), ("reset_peak",), ("save",), ("export", "/tmp/export"), ("load", 2),
                             ("delete", 2), ("restart",)]
    assert "restart done" in view.message.value


def test_confirmation_names_the_step_and_cancel_does_nothing():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    actions = RecordingActions()
    view = DashboardView(model, actions)
    view.refresh("ready")
    view.steps.value = 2
    view.delete_button.click()
    assert "Delete step 2?" in view.question.value
    view.confirm.children[2].click()  # Cancel
    assert actions.calls == [] and view.confirm.layout.display == "none"


def test_refused_action_shows_one_line_and_calls_nothing():
    model = _model()
    actions = RecordingActions()
    view = DashboardView(model, actions)
    view.load_button.click()
    assert "select a checkpoint" in view.message.value and actions.calls == []
    view.export_button.click()
    assert "give a path" in view.message.value


def test_loss_plot_has_a_point_per_logged_step():
    model = _model(world_size=1)
    points = tuple(MetricPoint(step=s, time=0.0, values={"loss": 3.0 - s / 10}) for s in range(5))
    model.observe(_gpu(0, 1, metrics=points))
    view = DashboardView(model, RecordingActions())
    view.refresh("ready")
    assert 'data-points="5"' in view.plot.value and "loss at step 4:" in view.plot.value
    assert "rank 0</span> 2.6" in view.plot.value


def test_mean_and_every_rank_curves():
    model = _model()
    for rank, offset in ((0, 0.0), (1, 2.0)):
        points = tuple(MetricPoint(step=s, time=0.0, values={"loss": 1.0 + offset, "lr": 0.1}) for s in range(3))
        model.observe(_gpu(rank, 1, metrics=points))
    assert model.metrics.series("loss", "mean") == {"mean": [(0, 2.0), (1, 2.0), (2, 2.0)]}
    assert list(model.metrics.series("loss", "all ranks")) == ["rank 0", "rank 1"]
    view = DashboardView(model, RecordingActions())
    view.refresh("ready")
    assert list(view.metric.options) == ["loss", "lr"]
    view.metric_view.value = "all ranks"
    view.refresh("ready")
    assert view.plot.value.count("<polyline") == 2


def test_text_tables_carry_the_same_facts():
    model = _model()
    model.observe(_gpu(0, 1, checkpoint=_view(latest=4)))
    text = markup.text_tables(model.rows(), model.checkpoint, "pool cpu 2 (ready)")
    assert "rank  state" in text and "cuda:0" in text and "4 LATEST" in text
    assert text.splitlines()[0] == "pool cpu 2 (ready)"


@pytest.mark.parametrize("num_bytes, text", [(512, "512 B"), (1536 * 2**20, "1.5 GiB"), (200 * 2**20, "200 MiB")])
def test_sizes_read_well(num_bytes, text):
    assert markup.size(num_bytes) == text


def _trainer_view(served: int = 0, committed: int = 0) -> CheckpointView:
    entries = (CheckpointEntry(step=3, path="/out/checkpoint-3", wall_time=1.7e9, size_bytes=2 * 2**20, world_size=2,
                               valid=True),
               CheckpointEntry(step=5, path="/out/checkpoint-5", wall_time=None, size_bytes=0, world_size=None,
                               valid=False))
    status = CheckpointStatus(directory="/out", latest_step=3, saving_step=None, last_error=None, entries=entries)
    return CheckpointView(status=status, requests_served=served, request_step=3 if served else None,
                          requests_committed=committed)


def test_a_trainers_checkpoints_are_listed_and_its_save_followed():
    model = DashboardModel()
    model.set_facts(PoolFacts(state="ready", world_size=2))
    model.observe(_gpu(0, 1.0, trainer_checkpoints=_trainer_view()))
    assert model.checkpoint is None and model.trainer_checkpoints.latest_step == 3
    shown = markup.trainer_checkpoints_html(model.trainer_checkpoints)
    assert shown.index("checkpoint-5") < shown.index("checkpoint-3")  # newest first
    assert "checkpoint-3 · " in shown and "2 ranks" in shown and "incomplete" in shown
    text = markup.text_tables(model.rows(), None, "pool", model.trainer_checkpoints)
    assert "no tracked checkpointer" in text and "Trainer checkpoints in /out" in text
    model.save_requested(1, "save requested: Trainer saves at the end of its next step")
    model.observe(_gpu(0, 1.0, trainer_checkpoints=_trainer_view(served=1)))
    assert model.save_text == "saving step 3 ..."
    model.observe(_gpu(0, 1.0, trainer_checkpoints=_trainer_view(served=1, committed=1)))
    assert model.save_text == "saved step 3" and not model.save_pending
    assert markup.trainer_checkpoints_html(None) == ""
    assert "asks the Trainer" in markup.checkpoint_header(None, model.trainer_checkpoints)
    assert "Checkpointer(dir).track" in markup.checkpoint_header(None)
    view = DashboardView(model, RecordingActions())
    view.refresh("ready")
    assert "checkpoint-3" in view.trainer_checkpoints.value and "asks the Trainer" in view.checkpoint_header.value


def test_the_step_kept_in_host_memory_is_shown_beside_latest():
    status = CheckpointStatus(directory="/ckpt/run1", latest_step=3, saving_step=None, last_error=None,
                              entries=(), memory_step=7)
    assert "LATEST 3 · <span class=\"fsdp2nb-memory-step\">step 7 in memory</span>" in markup.checkpoint_header(status)
    assert "(LATEST 3; step 7 in memory)" in markup.text_tables([], status, "pool")
    without = CheckpointStatus(directory="/ckpt/run1", latest_step=3, saving_step=None, last_error=None, entries=())
    assert "in memory" not in markup.checkpoint_header(without)
