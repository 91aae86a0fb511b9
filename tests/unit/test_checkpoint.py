"""Checkpointer behaviour in one process: layout, retention, bad input, errors, LoRA state."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch

from fsdp2nb.checkpoint import (
    Checkpointer,
    CheckpointMismatchError,
    CheckpointSaveError,
    CheckpointStatus,
    in_flight,
    tracking,
)
from fsdp2nb.checkpoint.layout import METADATA_FILE, file_crc32, read_latest, read_metadata
from fsdp2nb.checkpoint.requests import RequestOutcome, SaveRequests
from fsdp2nb.checkpoint.staging import ReusedBufferStager
from fsdp2nb.checkpoint.state import read_dcp_metadata
from fsdp2nb.checkpoint.tracking import tracked_checkpointer
from fsdp2nb.examples.tiny_models import make_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optimizer(seed: int = 0, **overrides):
    model = make_tiny_model("llama", seed=seed, **overrides)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer) -> None:
    ids = torch.randint(0, 131, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def trained():
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    return model, optimizer


def test_keep_zero_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"keep=0 is not allowed; choose None \(keep all\) or an int >= 1"):
        Checkpointer(tmp_path, keep=0)
    assert list(tmp_path.iterdir()) == []


def test_unknown_async_writer_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"async_writer='fork' is not allowed; choose one of \('process', 'thread'\)"):
        Checkpointer(tmp_path, async_writer="fork")
    assert list(tmp_path.iterdir()) == []


def test_async_save_switched_between_saves_is_read_from_the_config(tmp_path, trained):
    model, optimizer = trained
    ckpt = Checkpointer(tmp_path, keep=2, async_save=True).track(model=model, optimizer=optimizer)
    ckpt.async_save = False
    assert (ckpt.async_save, ckpt.config.async_save, ckpt.keep, ckpt.async_writer) == (False, False, 2, "thread")
    ckpt.save(1)  # synchronous: committed before it returns, with no wait()
    assert read_latest(tmp_path) == 1
    with pytest.raises(ValueError, match=r"async_save='yes' is not allowed; choose one of \(True, False\)"):
        ckpt.async_save = "yes"
    assert ckpt.async_save is False
    ckpt.close()


@pytest.mark.parametrize("kind", ["under_a_file", "proc"])
def test_unwritable_directory_is_refused_at_creation(tmp_path, kind):
    if kind == "under_a_file":
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "ckpt"
    else:
        target = Path("/proc/fsdp2nb-ckpt")
    with pytest.raises(ValueError, match="is not writable on rank 0"):
        Checkpointer(target)


def test_bad_step_and_unknown_step_change_nothing(tmp_path, trained):
    model, optimizer = trained
    ckpt = Checkpointer(tmp_path, async_save=False).track(model=model, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"step=-1 must be an int >= 0"):
        ckpt.save(-1)
    with pytest.raises(ValueError, match="no step has been seen"):
        ckpt.save()
    ckpt.save(3)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"step=4 has no complete checkpoint .* available: \[3\]"):
        ckpt.load(4)
    with pytest.raises(ValueError, match="target=1.5"):
        ckpt.load(1.5)
    for key, value in _snapshot(model).items():
        assert torch.equal(value, before[key])
    assert [e.step for e in ckpt.list()] == [3]
    ckpt.close()


def test_layout_metadata_and_latest(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(100)
        ckpt.wait()
        step_dir = tmp_path / "step-000100"
        assert {".metadata", METADATA_FILE, "rank-00000.pt"} <= set(os.listdir(step_dir))
        assert read_latest(tmp_path) == 100 and ckpt.latest() == 100
        (entry,) = ckpt.list()
        assert (entry.step, entry.world_size, entry.valid) == (100, 1, True) and entry.size_bytes > 0
        keys = read_dcp_metadata(step_dir).state_dict_metadata
        assert any(k.startswith("model.") for k in keys) and any(k.startswith("optim.") for k in keys)


def test_directory_without_metadata_is_never_a_checkpoint(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
        ckpt.save(2)
        (tmp_path / "step-000002" / METADATA_FILE).unlink()
        assert [(e.step, e.valid) for e in ckpt.list()] == [(1, True), (2, False)]
        assert ckpt.latest() == 1  # LATEST names step 2, which is incomplete
        assert ckpt.load("latest") == 1
        with pytest.raises(ValueError, match="step=2 has no complete checkpoint"):
            ckpt.load(2)


def test_retention_keeps_newest_and_never_deletes_latest(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path, keep=2) as ckpt:
        ckpt.track(model=model, optimizer=optimizer)
        for step in (1, 2, 3, 4):
            ckpt.save(step)
        ckpt.wait()
        assert [e.step for e in ckpt.list()] == [3, 4]
        ckpt.save(0)  # a step below the others: they are another run's, neither counted nor deleted
        ckpt.wait()
        assert [e.step for e in ckpt.list()] == [0, 3, 4] and ckpt.latest() == 0


def test_retention_after_resuming_from_an_earlier_step_keeps_the_new_run(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path, keep=3) as ckpt:
        ckpt.track(model=model, optimizer=optimizer)
        for step in (10, 20, 30):
            ckpt.save(step)
        ckpt.load(10)
        for step in (11, 12):
            ckpt.save(step)
        ckpt.wait()
        assert [e.step for e in ckpt.list()] == [10, 11, 12, 20, 30]  # the step resumed from stays
        ckpt.save(13)
        ckpt.wait()
        assert [e.step for e in ckpt.list()] == [11, 12, 13, 20, 30] and ckpt.latest() == 13


def test_abandoned_temporary_directories_are_cleaned(tmp_path, trained):
    model, optimizer = trained
    abandoned = tmp_path / ".tmp-step-000007-deadbeef"
    abandoned.mkdir()
    (abandoned / "__0_0.distcp").write_bytes(b"partial")
    with Checkpointer(tmp_path) as ckpt:
        assert not abandoned.exists()
        ckpt.track(model=model, optimizer=optimizer).save(7)
        ckpt.wait()
        assert [(e.step, e.valid) for e in ckpt.list()] == [(7, True)]


def test_saving_a_step_twice_replaces_it_whole(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(5)
        _step(model, optimizer)
        expected = _snapshot(model)
        ckpt.save(5)
        ckpt.wait()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-000005"]
        fresh, fresh_optimizer = _model_and_optimizer(seed=4)
        ckpt.track(model=fresh, optimizer=fresh_optimizer)
        assert ckpt.load(5) == 5
        for key, value in _snapshot(fresh).items():
            assert torch.equal(value, expected[key]), key


def test_replaced_checkpoint_left_aside_by_a_crash_is_restored(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(5)
    # What a crash between the two renames of a same-step replacement leaves behind.
    os.rename(tmp_path / "step-000005", tmp_path / ".old-step-000005-0a1b")
    with Checkpointer(tmp_path) as ckpt:
        assert [(e.step, e.valid) for e in ckpt.list()] == [(5, True)]


def test_mismatched_model_fails_before_changing_anything(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
    other, other_optimizer = _model_and_optimizer(seed=2, intermediate_size=72, num_hidden_layers=3)
    before = _snapshot(other)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=other, optimizer=other_optimizer)
        with pytest.raises(CheckpointMismatchError) as info:
            ckpt.load("latest")
    message = str(info.value)
    assert "missing from checkpoint: model.model.layers.2" in message
    assert "shape differs: model.model.layers.0.mlp.gate_proj.weight (70, 30) in checkpoint vs (72, 30) here" in message
    for key, value in _snapshot(other).items():
        assert torch.equal(value, before[key]), key
    assert not other_optimizer.state  # the probe used to build optimizer keys was undone


class _Unpicklable:
    """An extra stateful whose state cannot be written: torch.save fails in the background."""

    def state_dict(self) -> dict:
        return {"fn": lambda: 0}  # deepcopy keeps a function; pickling a lambda fails

    def load_state_dict(self, state: dict) -> None:
        pass


def test_background_error_is_raised_at_the_next_call_and_reported(tmp_path, trained):
    model, optimizer = trained
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt.track(model=model, optimizer=optimizer).save(1)
    ckpt.wait()
    ckpt.track(model=model, optimizer=optimizer, bad=_Unpicklable())
    ckpt.save(2)
    ckpt._background.wait()  # let the background save finish (fail) without consuming it
    status = ckpt.status()
    assert status.last_error is not None and "step 2" in status.last_error
    with pytest.raises(CheckpointSaveError, match="earlier background save failed"):
        ckpt.save(3)
    assert ckpt.latest() == 1 and [e.step for e in ckpt.list()] == [1]
    ckpt.close()
    ckpt.close()  # a second close is a no-op


def test_a_failed_synchronous_save_leaves_no_temporary_directory(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
        first_state = next(iter(optimizer.state.values()))
        first_state["unwritable"] = lambda: 0  # DCP cannot pickle it
        with pytest.raises(CheckpointSaveError) as raised:
            ckpt.save(2)
        message = str(raised.value)
        assert "save of step 2 failed" in message and "committed before are untouched" in message
        assert "AttributeError: Can't pickle local object" in message and "FrameSummary" not in message
        del first_state["unwritable"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-000001"]
        assert not in_flight.live_in(tmp_path)
        assert ckpt.latest() == 1


def test_status_is_a_picklable_snapshot(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(2)
        ckpt.wait()
        status = ckpt.status()
    assert isinstance(status, CheckpointStatus)
    copy = pickle.loads(pickle.dumps(status))
    assert copy == status and copy.latest_step == 2 and copy.saving_step is None
    assert copy.entries[0].step == 2


def test_tracked_checkpointer_is_the_last_to_track(tmp_path, trained, monkeypatch):
    monkeypatch.setattr(tracking, "_tracked", None)
    with pytest.raises(RuntimeError, match=r"Checkpointer\(directory\)\.track"):
        tracked_checkpointer()
    model, optimizer = trained
    first = Checkpointer(tmp_path / "a").track(model=model, optimizer=optimizer)
    second = Checkpointer(tmp_path / "b").track(model=model, optimizer=optimizer)
    assert tracked_checkpointer() is second
    second.save(4)  # what `%fsdp2 save` runs; a later bare save() reuses the step
    tracked_checkpointer().save()
    second.wait()
    assert second.latest() == 4
    second.close()
    first.close()


def test_maybe_save_serves_each_request_once(tmp_path, trained):
    model, optimizer = trained
    requests = SaveRequests()
    with Checkpointer(tmp_path, requests=requests) as ckpt:
        ckpt.track(model=model, optimizer=optimizer)
        assert not ckpt.maybe_save(0)
        request_id = requests.post()
        assert ckpt.maybe_save(1) and not ckpt.maybe_save(2)
        requests.post(request_id)  # the same request again: already served
        assert not ckpt.maybe_save(3)
        ckpt.wait()
        assert ckpt.latest() == 1
    with pytest.raises(ValueError, match="request_id=0"):
        requests.post(0)


def test_a_request_records_its_step_and_whether_it_committed(tmp_path, trained):
    """What the dashboard follows: not LATEST, which names step 1 before a second save of step 1."""
    model, optimizer = trained
    requests = SaveRequests()
    with Checkpointer(tmp_path, requests=requests) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
        ckpt.wait()
        first = requests.post()
        assert ckpt.maybe_save(1)
        assert requests.outcome().served == first and requests.outcome().step == 1
        ckpt.wait()
        assert requests.outcome() == RequestOutcome(served=first, step=1, committed=first, error=None)
        first_state = next(iter(optimizer.state.values()))
        first_state["unwritable"] = lambda: 0  # DCP cannot pickle it: the next save fails
        second = requests.post()
        try:
            with pytest.raises(CheckpointSaveError):
                ckpt.maybe_save(2)
                ckpt.wait()
        finally:
            del first_state["unwritable"]
        outcome = requests.outcome()
        assert (outcome.served, outcome.step, outcome.committed) == (second, 2, first)
        assert "save of step 2 failed" in outcome.error


def test_lora_saves_only_trainable_state_and_restores_it(tmp_path):
    from peft import LoraConfig, get_peft_model

    def lora_model(seed: int):
        base = make_tiny_model("llama", seed=0)
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=False))
        params = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(params, lr=1e-2)

    model, optimizer = lora_model(seed=1)
    _step(model, optimizer)
    expected = _snapshot(model)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
    saved = read_dcp_metadata(tmp_path / "step-000001").state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    metadata = (tmp_path / "step-000001" / METADATA_FILE).read_text()
    assert '"trainable_only": true' in metadata and "q_proj" in metadata

    fresh, fresh_optimizer = lora_model(seed=2)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.track(model=fresh, optimizer=fresh_optimizer).load(1)
    for key, value in _snapshot(fresh).items():
        assert torch.equal(value, expected[key]), key


def test_a_new_checkpointer_spares_a_save_in_flight(tmp_path):
    live = tmp_path / ".tmp-step-000001-0badc0de"
    abandoned = tmp_path / ".tmp-step-000002-0badf00d"
    live.mkdir()
    abandoned.mkdir()
    in_flight.started(live)  # what Checkpointer.save registers until its commit ends
    try:
        Checkpointer(tmp_path).close()
    finally:
        in_flight.ended(live)
    assert live.exists() and not abandoned.exists()


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    import io
    import random

    import numpy as np

    from fsdp2nb.checkpoint.rng import capture_rng_state, restore_rng_state

    state = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restore_rng_state(torch.load(buffer, weights_only=True))
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[:2] == again[:2] and torch.equal(expected[2], again[2])


class _SlowStager(ReusedBufferStager):
    """Copies after a pause, so the optimizer step below would overtake an ungated copy."""

    def _copy(self, obj, path):
        if path == "":
            time.sleep(0.5)
        return super()._copy(obj, path)


def test_optimizer_step_waits_for_the_copy_of_an_async_save(tmp_path, trained):
    model, optimizer = trained
    ckpt = Checkpointer(tmp_path, async_save=True)
    ckpt._stager.close()
    ckpt._stager = _SlowStager()
    ckpt.track(model=model, optimizer=optimizer)
    at_save = _snapshot(model)
    ckpt.save(1)  # returns while the copy sleeps
    _step(model, optimizer)  # its optimizer step must wait for the copy
    ckpt.wait()
    assert ckpt.status().blocked_s == ckpt.blocked_s > 0  # the save call and the step's wait
    ckpt.close()
    fresh, fresh_optimizer = _model_and_optimizer(seed=3)
    with Checkpointer(tmp_path) as loader:
        loader.track(model=fresh, optimizer=fresh_optimizer)
        loader.load(1)
    for key, tensor in _snapshot(fresh).items():
        assert torch.equal(tensor, at_save[key]), key


def test_status_lists_the_directory_again_only_after_it_changed(tmp_path, trained, monkeypatch):
    from fsdp2nb.checkpoint import layout

    listings = []
    real_list_entries = layout.list_entries
    monkeypatch.setattr(layout, "list_entries", lambda d: listings.append(d) or real_list_entries(d))
    model, optimizer = trained
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
        settled = os.stat(tmp_path).st_mtime - 60
        os.utime(tmp_path, (settled, settled))  # as if saved a minute ago
        listings.clear()
        assert ckpt.status().latest_step == ckpt.status().latest_step == 1
        assert len(listings) == 1  # the second status came from what the first one read
        ckpt.save(2)  # renames into the directory: its time changes
        listings.clear()
        status = ckpt.status()
        assert status.latest_step == 2 and [e.step for e in status.entries] == [1, 2]
        assert len(listings) == 1


def test_staging_copies_tensors_and_keeps_other_values_such_as_classes():
    # DCP's DefaultStager (torch 2.11) failed on a class object in the state; ours keeps it.
    stager = ReusedBufferStager()
    try:
        weight = torch.arange(6.0)
        staged = stager.stage({"model": {"w": weight}, "extra": {"kind": torch.nn.Linear, "step": 3}}).result()
        weight.add_(1)  # the staged copy must not follow later writes
        assert torch.equal(staged["model"]["w"], torch.arange(6.0))
        assert staged["extra"] == {"kind": torch.nn.Linear, "step": 3}
    finally:
        stager.close()


def test_the_tracked_checkpointer_is_read_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys; from fsdp2nb.checkpoint.tracking import current_checkpointer; "
            "import fsdp2nb.worker.sampler; "
            "assert current_checkpointer() is None; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_deleting_latest_points_latest_at_the_previous_step(trained, tmp_path):
    """The dashboard's Delete of LATEST (confirmed twice): a resume then loads the step before."""
    from fsdp2nb.worker.commands import delete_checkpoint

    model, optimizer = trained
    with Checkpointer(tmp_path, async_save=False) as checkpointer:
        checkpointer.track(model=model, optimizer=optimizer)
        checkpointer.save(1)
        checkpointer.save(2)
        delete_checkpoint(2)
        assert read_latest(tmp_path) == 1 and checkpointer.status().latest_step == 1
        delete_checkpoint(1)
        assert read_latest(tmp_path) is None and checkpointer.status().latest_step is None


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00step", b"step-000002\xe9\n", b"not a step\n"])
def test_latest_holding_garbage_falls_back_to_the_newest_complete_step(tmp_path, trained, garbage):
    model, optimizer = trained
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
        ckpt.save(2)
        (tmp_path / "LATEST").write_bytes(garbage)
        assert read_latest(tmp_path) is None
        assert ckpt.latest() == 2 and ckpt.load("latest") == 2


def _optimizer_snapshot(optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": value.clone() for i, state in enumerate(optimizer.state.values())
            for name, value in state.items()}


def _assert_unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


def _damage(shard: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    else:  # 256 bytes in the middle overwritten: the size stays
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            f.write(bytes(range(256)))


@pytest.fixture
def two_steps(tmp_path, trained, caplog):
    """Steps 1 and 2 saved; the model and optimizer as they were at step 1; trained on since."""
    model, optimizer = trained
    ckpt = Checkpointer(tmp_path, async_save=False).track(model=model, optimizer=optimizer)
    ckpt.save(1)
    at_step1 = _snapshot(model), _optimizer_snapshot(optimizer)
    _step(model, optimizer)
    ckpt.save(2)
    _step(model, optimizer)
    yield ckpt, model, optimizer, at_step1
    ckpt.close()


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_step_is_refused_whole_and_latest_takes_the_step_before(tmp_path, two_steps, caplog, how):
    ckpt, model, optimizer, at_step1 = two_steps
    (shard,) = (tmp_path / "step-000002").glob("*.distcp")
    _damage(shard, how)
    before = _snapshot(model), _optimizer_snapshot(optimizer)
    # A truncation shows in the listing; a same-size overwrite once a load has read the bytes.
    assert [(e.step, e.valid) for e in ckpt.list()] == [(1, True), (2, how == "overwritten")]
    with pytest.raises(ValueError, match=rf"step.2 .*{shard.name}") as refused:
        ckpt.load(2)
    assert "\n" not in str(refused.value)
    _assert_unchanged(before[0], _snapshot(model))
    _assert_unchanged(before[1], _optimizer_snapshot(optimizer))
    assert [(e.step, e.valid) for e in ckpt.list()] == [(1, True), (2, False)] and ckpt.latest() == 1
    caplog.clear()
    assert ckpt.load("latest") == 1
    _assert_unchanged(at_step1[0], _snapshot(model))
    _assert_unchanged(at_step1[1], _optimizer_snapshot(optimizer))
    notes = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(notes) == 1 and "step 2" in notes[0] and shard.name in notes[0] and "step 1" in notes[0]


def test_a_step_found_damaged_is_valid_again_once_saved_again(tmp_path, two_steps):
    ckpt, model, optimizer, _ = two_steps
    (shard,) = (tmp_path / "step-000002").glob("*.distcp")
    _damage(shard, "overwritten")
    assert ckpt.load("latest") == 1
    assert [(e.step, e.valid) for e in ckpt.list()] == [(1, True), (2, False)]
    ckpt.save(2)
    assert [(e.step, e.valid) for e in ckpt.list()] == [(1, True), (2, True)]
    assert ckpt.load("latest") == 2


def test_checksums_are_recorded_per_file_and_can_be_left_off(tmp_path, trained):
    model, optimizer = trained
    for checksums in (True, False):
        directory = tmp_path / str(checksums)
        with Checkpointer(directory, async_save=False, checksums=checksums) as ckpt:
            ckpt.track(model=model, optimizer=optimizer).save(1)
        step_dir = directory / "step-000001"
        files = read_metadata(step_dir).files
        assert set(files) == {p.name for p in step_dir.iterdir()} - {METADATA_FILE}  # no .crc32 left
        for name, (size, crc) in files.items():
            assert size == (step_dir / name).stat().st_size
            if name.endswith(".distcp") and not checksums:
                assert crc is None
            else:
                assert crc == file_crc32(step_dir / name)


def test_a_checkpoint_without_recorded_sizes_and_checksums_still_loads(tmp_path, trained):
    model, optimizer = trained
    with Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(1)
        saved = _snapshot(model)
        metadata_path = tmp_path / "step-000001" / METADATA_FILE
        written = json.loads(metadata_path.read_text())
        del written["files"]  # as written before files were recorded
        metadata_path.write_text(json.dumps(written))
        _step(model, optimizer)
        assert [e.valid for e in ckpt.list()] == [True] and ckpt.load("latest") == 1
        _assert_unchanged(saved, _snapshot(model))
