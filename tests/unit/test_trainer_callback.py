"""fsdp2nb.TrainerCallback in one process: Trainer's logs reach fsdp2nb.log, a posted save and a
posted stop set Trainer's control flags at the next step, progress is reported, bad input is one line."""

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from transformers import TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from fsdp2nb import progress  # noqa: E402
from fsdp2nb.checkpoint.requests import post_save_request, process_stops  # noqa: E402
from fsdp2nb.engine.trainer_callback import TrainerCallback  # noqa: E402
from fsdp2nb.metrics import process_metrics  # noqa: E402


@pytest.fixture
def args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=5)


@pytest.fixture
def updates():
    seen = []
    progress.install(seen.append)
    yield seen
    progress.install(None)


def test_logs_saves_stops_and_progress(args, updates):
    callback, state, control = TrainerCallback(), TrainerState(max_steps=5), TrainerControl()
    process_metrics().drain()
    callback.on_train_begin(args, state, control)
    state.global_step = 1
    callback.on_step_end(args, state, control)
    assert not control.should_save and not control.should_training_stop
    callback.on_log(args, state, control, logs={"loss": 2.5, "learning_rate": 1e-3, "note": "text"})
    assert [(p.step, p.values) for p in process_metrics().drain()] == [(1, {"loss": 2.5, "learning_rate": 1e-3})]
    post_save_request()
    state.global_step = 2
    callback.on_step_end(args, state, control)
    assert control.should_save
    control = TrainerControl()
    callback.on_step_end(args, state, control)
    assert not control.should_save  # served once
    assert process_stops().post()  # what the rank's control thread does on the dashboard's Stop
    callback.on_step_end(args, state, control)
    assert control.should_training_stop
    callback.on_train_end(args, state, control)
    assert not process_stops().post()  # nobody listens once training ended: the rank interrupts
    assert [u.kind for u in updates] == ["train"] * len(updates)
    assert updates[-1].finished and updates[-1].total_items == 5 and updates[-1].done_items == 4


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
