"""Snapshots in host memory (`memory_every`): taken by one set of ranks, restored bitwise by the
next (new processes, as after a pool restart), refused for another model or world size."""

from __future__ import annotations

import os
import random
import subprocess

import pytest
import torch

from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.checkpoint.memory_snapshots import MemorySnapshotFailed
from fsdp2nb.errors import MemorySnapshotRefused
from fsdp2nb.host import memory_store
from tests.support.checkpoint_helpers import (
    assert_same,
    build,
    full_model_state,
    full_optim_state,
    train_step,
)
from tests.support.gloo_harness import run_ranks

SNAPSHOT_STEP = 4
NUM_STEPS = 7


def _seeded(rank: int) -> None:
    torch.manual_seed(1234 + rank)
    random.seed(rank)


def _train(store: str, directory: str, *, stop_after: int) -> dict:
    """Snapshots at every step to `stop_after`, then training on in the same processes: the run
    without a fault that a restored one must equal."""
    import torch.distributed as dist

    os.environ[memory_store.MEMORY_DIR_ENV] = store
    _seeded(dist.get_rank())
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler)
    losses = []
    for step in range(stop_after + 1):
        losses.append(train_step(model, optimizer, scheduler))
        ckpt.maybe_save(step)
    ckpt.wait()
    at_stop = (full_model_state(model), full_optim_state(model, optimizer), scheduler.get_last_lr())
    rest = [train_step(model, optimizer, scheduler) for _ in range(stop_after + 1, NUM_STEPS)]
    ckpt.close()
    return dict(losses=losses, at_stop=at_stop, rest=rest)


def _restore(store: str, directory: str) -> dict:
    import torch.distributed as dist

    os.environ[memory_store.MEMORY_DIR_ENV] = store
    torch.manual_seed(999)  # the restored run must not depend on the generator's state now
    model, optimizer, scheduler = build(seed=7)
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler)
    restored = ckpt.last_step
    state = (full_model_state(model), full_optim_state(model, optimizer), scheduler.get_last_lr())
    rest = [train_step(model, optimizer, scheduler) for _ in range(restored + 1, NUM_STEPS)]
    latest = ckpt.latest()
    ckpt.close()
    return dict(restored=restored, state=state, rest=rest, latest=latest, rank=dist.get_rank())


def _written_to_disk_then_loaded(store: str, directory: str, elsewhere: str) -> dict:
    os.environ[memory_store.MEMORY_DIR_ENV] = store
    _seeded(0)
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler)
    for step in range(SNAPSHOT_STEP + 1):
        train_step(model, optimizer, scheduler)
        ckpt.maybe_save(step)
    ckpt.wait()
    at_snapshot = (full_model_state(model), full_optim_state(model, optimizer))
    train_step(model, optimizer, scheduler)  # the live state moves on; the snapshot stays at its step
    written = ckpt.save_memory_snapshot(elsewhere)
    live_after = full_model_state(model)
    ckpt.close()
    model, optimizer, scheduler = build(seed=7)
    reader = Checkpointer(elsewhere).track(model=model, optimizer=optimizer, scheduler=scheduler)
    loaded = reader.load("latest")
    state = (full_model_state(model), full_optim_state(model, optimizer))
    reader.close()
    return dict(written=written, loaded=loaded, at_snapshot=at_snapshot, state=state, live_after=live_after)


def _refused_for_other_model(store: str, directory: str, elsewhere: str) -> tuple[str, str]:
    """The refusal of another model's snapshot, and that of `load("memory")` where none is kept."""
    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=7, hidden_size=48)
    before = full_model_state(model)
    try:
        Checkpointer(directory).track(model=model, optimizer=optimizer, scheduler=scheduler)
        other_model = "not refused"
    except MemorySnapshotRefused as refused:
        assert_same(before, full_model_state(model))  # nothing changed
        assert not optimizer.state
        other_model = str(refused)
    return other_model, _load_memory_without_snapshot(model, optimizer, elsewhere)


def _refused_for_other_world_size(store: str, directory: str) -> str:
    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, _ = build(seed=0)
    try:
        Checkpointer(directory).track(model=model, optimizer=optimizer)
    except MemorySnapshotRefused as refused:
        assert not optimizer.state
        return str(refused)
    return "not refused"


def _load_memory_without_snapshot(model, optimizer, directory: str) -> str:
    ckpt = Checkpointer(directory).track(model=model, optimizer=optimizer)
    try:
        ckpt.load("memory")
    except ValueError as refused:
        return str(refused)
    finally:
        ckpt.close()
    return "not refused"


@pytest.fixture()
def store(tmp_path):
    directory = memory_store.stores_root() / f"test-{os.getpid()}-{random.getrandbits(32)}"
    directory.mkdir(mode=0o700)
    yield str(directory)
    memory_store.remove_store(directory)


def test_a_new_set_of_ranks_restores_the_snapshot_bitwise_and_trains_on_alike(store, tmp_path):
    directory = str(tmp_path / "ckpt")
    first = run_ranks(_train, 2, store, directory, stop_after=SNAPSHOT_STEP)  # then trains on, unfaulted
    kept = memory_store.kept_snapshots(store)
    assert [(k.step, k.num_ranks_here, k.world_size) for k in kept] == [(SNAPSHOT_STEP, 2, 2)]

    second = run_ranks(_restore, 2, store, directory)
    for before, after in zip(first, second, strict=True):
        assert after["restored"] == SNAPSHOT_STEP and after["latest"] == SNAPSHOT_STEP
        assert_same(before["at_stop"][0], after["state"][0])
        assert_same(before["at_stop"][1], after["state"][1])
        assert before["at_stop"][2] == after["state"][2]
        assert before["rest"] == after["rest"]


def test_a_snapshot_written_to_disk_loads_as_its_step(store, tmp_path):
    outcomes = run_ranks(_written_to_disk_then_loaded, 2, store, str(tmp_path / "ckpt"), str(tmp_path / "elsewhere"))
    for outcome in outcomes:
        assert outcome["written"] == outcome["loaded"] == SNAPSHOT_STEP
        assert_same(outcome["at_snapshot"][0], outcome["state"][0])
        assert_same(outcome["at_snapshot"][1], outcome["state"][1])
        assert any(not torch.equal(outcome["live_after"][k], outcome["at_snapshot"][0][k])
                   for k in outcome["live_after"])  # the live model had moved on, and was left so


def test_a_snapshot_of_another_model_or_world_size_is_refused(store, tmp_path):
    directory = str(tmp_path / "ckpt")
    run_ranks(_train, 2, store, directory, stop_after=2)
    messages = run_ranks(_refused_for_other_model, 2, store, directory, str(tmp_path / "elsewhere"))
    for other_model, nothing_kept in messages:
        assert "of another model" in other_model and "nothing was changed" in other_model, other_model
        assert "no snapshot of" in nothing_kept, nothing_kept
    other = run_ranks(_refused_for_other_world_size, 3, store, directory)
    assert all("taken on 2 ranks, this pool has 3" in message for message in other), other


def _refused_for_lack_of_room(store: str, directory: str) -> tuple[str, list[str]]:
    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler)
    train_step(model, optimizer, scheduler)
    try:
        ckpt.maybe_save(0)
    except MemorySnapshotRefused as refused:
        train_step(model, optimizer, scheduler)  # training goes on as before
        files = sorted(path.name for path in memory_store.checkpointer_folder(store, ckpt.directory).iterdir())
        ckpt.close()
        return str(refused), files
    return "not refused", []


def test_a_snapshot_the_host_has_no_room_for_is_refused_before_any_copy(tmp_path):
    small = tmp_path / "small-tmpfs"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(small)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs was refused: {mounted.stderr.strip()}")
    try:
        outcomes = run_ranks(_refused_for_lack_of_room, 2, str(small), str(tmp_path / "ckpt"))
    finally:
        subprocess.run(["umount", "--lazy", str(small)], check=False)
    for message, files in outcomes:
        assert "need" in message and "but" in message and "is available" in message, message
        assert "nothing was copied" in message, message
        assert not [name for name in files if ".slot" in name], files  # no slot was made


class _Ticks:
    """An extra tracked object; one that refuses its state back fails a restore after the ranks agreed."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.count, self.refuse = 0, refuse

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if self.refuse:
            raise RuntimeError("this rank cannot take its ticks back")
        self.count = state["count"]


def _train_with_ticks(store: str, directory: str, *, num_steps: int) -> None:
    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=0)
    ticks = _Ticks()
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler,
                                                         ticks=ticks)
    for step in range(num_steps):
        train_step(model, optimizer, scheduler)
        ticks.count += 1
        ckpt.maybe_save(step)
    ckpt.close()


def _restore_refused_by_rank_1(store: str, directory: str) -> str:
    import torch.distributed as dist

    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=7)
    try:
        Checkpointer(directory).track(model=model, optimizer=optimizer, scheduler=scheduler,
                                      ticks=_Ticks(refuse=dist.get_rank() == 1))
    except MemorySnapshotFailed as failed:
        return str(failed)
    return "not refused"


def test_a_restore_that_fails_on_one_rank_after_the_ranks_agreed_fails_on_every_rank(store, tmp_path):
    directory = str(tmp_path / "ckpt")
    run_ranks(_train_with_ticks, 2, store, directory, num_steps=2)
    messages = run_ranks(_restore_refused_by_rank_1, 2, store, directory)
    assert "rank 1: restoring step 1 from memory failed: RuntimeError: this rank cannot take" in messages[1], messages
    assert "failed on rank 1" in messages[0] and "cannot take its ticks back" in messages[0], messages
    assert all("load a step again before training" in message for message in messages), messages


def _restore_with_unreadable_state(store: str, directory: str) -> str:
    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=7)
    before = full_model_state(model)
    try:
        Checkpointer(directory).track(model=model, optimizer=optimizer, scheduler=scheduler)
    except MemorySnapshotRefused as refused:
        assert_same(before, full_model_state(model))  # nothing changed
        return str(refused)
    return "not refused"


def test_a_state_file_unreadable_on_one_rank_is_refused_on_every_rank(store, tmp_path):
    directory = str(tmp_path / "ckpt")
    run_ranks(_train_with_ticks, 2, store, directory, num_steps=2)
    folder = memory_store.checkpointer_folder(store, directory)
    for state_file in folder.glob("rank-00001.slot*.state"):
        state_file.write_bytes(b"")  # reading it raises EOFError
    messages = run_ranks(_restore_with_unreadable_state, 2, store, directory)
    assert "rank 1: the snapshot of step 1 cannot be read (EOFError" in messages[1], messages
    assert "restoring from memory failed on rank 1" in messages[0], messages
    assert all("nothing was changed" in message for message in messages), messages


def _copy_fails_on_rank_1(store: str, directory: str) -> list[str]:
    """Rank 1's copy of step 1 cannot write its state (a directory is in the way)."""
    import torch.distributed as dist

    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler)
    obstacle = memory_store.checkpointer_folder(store, ckpt.directory) / "rank-00001.slot0.state"
    if dist.get_rank() == 1:
        obstacle.mkdir()  # step 0 goes into slot 1, step 1 into slot 0
    outcomes = []
    for step in range(5):
        train_step(model, optimizer, scheduler)  # rank 1's optimizer step after the failed copy: no raise
        try:
            ckpt.maybe_save(step)
            outcomes.append("taken")
        except MemorySnapshotFailed as failed:
            outcomes.append(str(failed))
            if dist.get_rank() == 1:
                obstacle.rmdir()
    ckpt.close()
    return outcomes


def test_a_copy_that_fails_on_one_rank_fails_a_later_snapshot_on_every_rank(store, tmp_path):
    """Rank 1 finds its failed copy at step 2's snapshot and skips it; the ranks hear of it, all
    alike, at step 3's (later snapshots post their exchange rather than wait for it)."""
    outcomes = run_ranks(_copy_fails_on_rank_1, 2, store, str(tmp_path / "ckpt"))
    for outcome in outcomes:
        assert outcome[:3] == ["taken", "taken", "taken"] and outcome[4] == "taken", outcome
    assert outcomes[1][3].startswith("rank 1: the snapshot of step 1 in host memory failed: IsADirectoryError"), outcomes
    assert "step 0 is whole, and training can go on" in outcomes[1][3], outcomes
    assert outcomes[0][3].startswith("the snapshots in host memory failed on rank 1: MemorySnapshotFailed: rank 1: "
                                     "the snapshot of step 1"), outcomes
    kept = memory_store.kept_snapshots(store)
    assert [snapshot.step for snapshot in kept] == [4], kept  # the snapshots went on


def _opened_where_one_host_holds_snapshots(store: str, empty_store: str, directory: str) -> tuple:
    import torch.distributed as dist

    os.environ[memory_store.MEMORY_DIR_ENV] = store if dist.get_rank() == 0 else empty_store
    model, optimizer, scheduler = build(seed=7)
    ckpt = Checkpointer(directory).track(model=model, optimizer=optimizer, scheduler=scheduler)
    outcome = (ckpt.last_step, ckpt.latest(), not optimizer.state)
    ckpt.close()
    return outcome


def test_snapshots_on_one_host_only_are_opened_on_every_rank_alike(store, tmp_path):
    """Rank 0's host kept snapshots, rank 1's did not (a new host): every rank opens the
    snapshots and they agree that no step is held by all, rather than rank 0 waiting alone."""
    directory = str(tmp_path / "ckpt")
    run_ranks(_train, 2, store, directory, stop_after=2)
    empty_store = memory_store.stores_root() / f"test-empty-{os.getpid()}-{random.getrandbits(32)}"
    try:
        outcomes = run_ranks(_opened_where_one_host_holds_snapshots, 2, store, str(empty_store), directory)
    finally:
        memory_store.remove_store(empty_store)
    assert outcomes == [(None, None, True), (None, None, True)], outcomes


def _written_with_a_state_unreadable_on_rank_1(store: str, directory: str, elsewhere: str) -> str:
    import torch.distributed as dist

    os.environ[memory_store.MEMORY_DIR_ENV] = store
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, memory_every=1).track(model=model, optimizer=optimizer, scheduler=scheduler)
    for step in range(2):
        train_step(model, optimizer, scheduler)
        ckpt.maybe_save(step)
    ckpt.wait()
    if dist.get_rank() == 1:
        for state_file in memory_store.checkpointer_folder(store, ckpt.directory).glob("rank-00001.slot*.state"):
            state_file.write_bytes(b"\x80")  # a truncated pickle
    try:
        ckpt.save_memory_snapshot(elsewhere)
        outcome = "written"
    except MemorySnapshotRefused as refused:
        outcome = str(refused)
    ckpt.close()
    return outcome


def test_a_snapshot_unreadable_on_one_rank_is_written_to_disk_by_none(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    messages = run_ranks(_written_with_a_state_unreadable_on_rank_1, 2, store, str(tmp_path / "ckpt"), str(elsewhere))
    assert "rank 1: the snapshot of step 1 cannot be read" in messages[1], messages
    assert "reading the snapshot in host memory failed on rank 1" in messages[0], messages
    assert all("nothing was written" in message for message in messages), messages
    assert not any(path.name.startswith("step") for path in elsewhere.glob("*")), list(elsewhere.glob("*"))
