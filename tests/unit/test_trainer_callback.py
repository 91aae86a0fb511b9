"""fsdp2nb.TrainerCallback in one process: Trainer's logs reach fsdp2nb.log, a posted save and a
posted stop set Trainer's control flags a step later, progress is reported, bad input is one line."""

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from transformers import TrainerControl, TrainerState, TrainingArguments

from fsdp2nb import progress
from fsdp2nb.checkpoint.requests import post_save_request, process_stops
from fsdp2nb.engine.trainer_callback import TrainerCallback
from fsdp2nb.metrics import process_metrics


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=5)


@pytest.fixture
def updates():
    seen = []
    progress.install(seen.append)
    yield seen
    progress.install(None)


def _step_end(callback: TrainerCallback, args, state: TrainerState, step: int) -> TrainerControl:
    state.global_step = step
    return callback.on_step_end(args, state, TrainerControl())


def test_logs_saves_stops_and_progress(args, updates):
    """A save or stop asked during a step is posted to the ranks at its end and acted on at the next."""
    callback, state = TrainerCallback(), TrainerState(max_steps=10)
    process_metrics().drain()
    callback.on_train_begin(args, state, TrainerControl())
    control = _step_end(callback, args, state, 1)
    assert not control.should_save and not control.should_training_stop
    callback.on_log(args, state, control, logs={"loss": 2.5, "learning_rate": 1e-3, "note": "text"})
    assert [(p.step, p.values) for p in process_metrics().drain()] == [(1, {"loss": 2.5, "learning_rate": 1e-3})]
    post_save_request()
    assert not _step_end(callback, args, state, 2).should_save  # posted, not yet agreed
    assert _step_end(callback, args, state, 3).should_save
    assert not _step_end(callback, args, state, 4).should_save  # served once
    assert process_stops().post()  # what the rank's control thread does on the dashboard's Stop
    assert not _step_end(callback, args, state, 5).should_training_stop
    control = _step_end(callback, args, state, 6)
    assert control.should_training_stop
    callback.on_train_end(args, state, control)
    assert not process_stops().post()  # nobody listens once training ended: the rank interrupts
    assert [u.kind for u in updates] == ["train"] * len(updates)
    assert updates[-1].finished and updates[-1].total_items == 10 and updates[-1].done_items == 6


def test_a_save_asked_during_the_last_step_is_taken_at_it(args, updates):
    """Nothing reads a posted agreement after the last step, so it is agreed there and then."""
    callback, state = TrainerCallback(), TrainerState(max_steps=3)
    callback.on_train_begin(args, state, TrainerControl())
    assert not _step_end(callback, args, state, 1).should_save
    assert not _step_end(callback, args, state, 2).should_save
    post_save_request()
    assert _step_end(callback, args, state, 3).should_save
    callback.on_train_end(args, state, TrainerControl())


def test_a_world_size_other_than_the_groups_is_one_line():
    args = SimpleNamespace(world_size=4)  # as built for 4 ranks, run on 1
    with pytest.raises(ValueError, match=r"^TrainingArguments has world_size=4 but the process group has 1 ranks"):
        TrainerCallback().on_train_begin(args, TrainerState(max_steps=5), TrainerControl())


def test_report_to_the_network_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    args.report_to = ["wandb"]
    with pytest.raises(ValueError, match=r"report_to=\['wandb'\] sends metrics over the network.*report_to='none'"):
        TrainerCallback().on_init_end(args, TrainerState(), TrainerControl())


def test_a_save_it_asked_for_is_committed_and_listed_once_trainer_saved(args, updates):
    from fsdp2nb.checkpoint import trainer_dirs
    from fsdp2nb.checkpoint.requests import process_requests

    callback, state, control = TrainerCallback(), TrainerState(max_steps=5), TrainerControl()
    callback.on_train_begin(args, state, control)
    assert trainer_dirs.published().entries == ()  # nothing saved yet, but the panel knows the directory
    request = post_save_request()
    state.global_step = 2
    callback.on_step_end(args, state, control)  # posted to the ranks, read at the next step's end
    state.global_step = 3
    callback.on_step_end(args, state, control)
    outcome = process_requests().outcome()
    assert control.should_save and (outcome.served, outcome.step) == (request, 3) and outcome.committed < request
    state_file = os.path.join(args.output_dir, "checkpoint-3", "trainer_state.json")
    os.makedirs(os.path.join(args.output_dir, "checkpoint-3", "fsdp2nb_dcp"))
    open(os.path.join(args.output_dir, "checkpoint-3", "fsdp2nb_dcp", ".metadata"), "w").close()
    with open(state_file, "w") as handle:
        handle.write("{}")  # what Trainer writes before calling on_save
    callback.on_save(args, state, control)
    assert process_requests().outcome().committed == request
    assert [(e.step, e.valid) for e in trainer_dirs.published().entries] == [(3, True)]
    callback.on_train_end(args, state, control)
