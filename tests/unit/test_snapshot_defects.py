"""Snapshots in host memory in one process (no process group, as one rank of one): what a snapshot
holds when the live state changes around it, what its small state can keep, which GPU its copy
runs on, and the rules its store's folders and files follow."""

from __future__ import annotations

import collections
import contextlib
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fsdp2nb.checkpoint import plain_pickle
from fsdp2nb.checkpoint.host_copy import DeviceToHostCopier, QueuedWork
from fsdp2nb.checkpoint.memory_snapshots import MemorySnapshots
from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.errors import MemorySnapshotRefused, UnsafeDirectory
from fsdp2nb.host import memory_store

NOBODY = 65534


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    return root / "session-1-1"


def _snapshots(store: Path, copier: ThreadPoolExecutor | None = None) -> MemorySnapshots:
    folder = memory_store.open_checkpointer_folder(store, "/ckpt")
    return MemorySnapshots(folder, Path("/ckpt"), rank=0, world_size=1, local_ranks=range(1), group=None,
                           copier=copier)


def _model_with_running_stats() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _restored(store: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    snapshots = _snapshots(store)
    try:
        step = snapshots.agreed_step()
        assert step is not None
        snapshots.restore(Tracked(model, optimizer, None, {}), step)
        return step
    finally:
        snapshots.close()


def test_running_statistics_are_kept_as_they_were_when_the_snapshot_was_taken(store):
    model, optimizer = _model_with_running_stats()
    started, release = threading.Event(), threading.Event()
    copier = ThreadPoolExecutor(1)
    copier.submit(lambda: (started.set(), release.wait()))  # the copy thread is busy: the copy waits
    snapshots = _snapshots(store, copier)
    started.wait()
    snapshots.take(Tracked(model, optimizer, None, {}), 0)
    at_take = model[1].running_mean.clone()
    model(torch.randn(8, 4) + 5)  # the next forward updates the running statistics in place
    assert not torch.equal(model[1].running_mean, at_take)
    release.set()
    snapshots.close()
    model[1].running_mean.zero_()
    _restored(store, model, optimizer)
    assert torch.equal(model[1].running_mean, at_take)


def test_a_snapshot_after_the_optimizer_state_was_replaced_holds_the_new_state(store):
    """`opt.load_state_dict` makes new state dicts; CPython often puts a new dict where a freed one
    was, so an id() can name another dict than before. Here each is made so where the old one is
    free to go (a snapshot that holds on to the old dicts keeps their ids from being reused)."""
    model, optimizer = _model_with_running_stats()
    snapshots = _snapshots(store)
    tracked = Tracked(model, optimizer, None, {})
    snapshots.take(tracked, 0)
    snapshots.wait()
    for param in list(optimizer.state):
        loaded = [(name, torch.full_like(value, 7.0)) for name, value in optimizer.state[param].items()]
        optimizer.state[param] = None  # the old dict is freed (unless something holds it) ...
        fresh: dict = {}  # ... and the new one is made where it was
        fresh.update(loaded)
        optimizer.state[param] = fresh
    snapshots.take(tracked, 1)
    snapshots.close()
    for state in optimizer.state.values():
        state["exp_avg"].zero_()
    assert _restored(store, model, optimizer) == 1
    assert all(torch.all(state["exp_avg"] == 7.0) for state in optimizer.state.values())


def test_a_snapshot_after_model_to_holds_the_moved_parameters(store):
    model, optimizer = _model_with_running_stats()
    snapshots = _snapshots(store)
    tracked = Tracked(model, optimizer, None, {})
    snapshots.take(tracked, 0)
    snapshots.wait()
    model.to(torch.float64)  # the same parameter objects, on new storage
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    snapshots.take(tracked, 1)
    snapshots.close()
    with torch.no_grad():
        model[0].weight.zero_()
    _restored(store, model, optimizer)
    assert model[0].weight.dtype == torch.float64 and torch.all(model[0].weight == 3.0)


class _OrderedDictState:
    """An extra stateful object whose state is what `nn.Module.state_dict()` gives: an OrderedDict."""

    def __init__(self) -> None:
        self.value = collections.OrderedDict(count=np.int64(3), shape=torch.Size([2, 3]), dtype=torch.bfloat16,
                                             empty=torch.empty(0, 4), scale=np.float32(0.5))

    def state_dict(self) -> collections.OrderedDict:
        return self.value

    def load_state_dict(self, state: collections.OrderedDict) -> None:
        self.value = state


def test_the_small_state_of_a_module_like_object_round_trips(store):
    model, optimizer = _model_with_running_stats()
    extra = _OrderedDictState()
    snapshots = _snapshots(store)
    snapshots.take(Tracked(model, optimizer, None, {"extra": extra}), 0)
    snapshots.close()
    restored = _OrderedDictState()
    restored.value = collections.OrderedDict()
    reader = _snapshots(store)
    reader.restore(Tracked(model, optimizer, None, {"extra": restored}), 0)
    reader.close()
    assert type(restored.value) is collections.OrderedDict and list(restored.value) == list(extra.value)
    assert restored.value["count"] == 3 and restored.value["shape"] == torch.Size([2, 3])
    assert restored.value["dtype"] is torch.bfloat16 and restored.value["empty"].shape == (0, 4)
    assert restored.value["scale"] == np.float32(0.5) and isinstance(restored.value["scale"], np.float32)


def test_state_that_cannot_be_read_back_is_refused_before_anything_is_written(store):
    model, optimizer = _model_with_running_stats()

    class Unreadable:
        def state_dict(self) -> dict:
            return {"counts": collections.Counter(a=1)}

        def load_state_dict(self, state: dict) -> None:
            raise AssertionError("never restored")

    snapshots = _snapshots(store)
    with pytest.raises(MemorySnapshotRefused, match=r"collections\.Counter cannot be kept.*nothing was copied"):
        snapshots.take(Tracked(model, optimizer, None, {"odd": Unreadable()}), 0)
    assert snapshots.newest_step() is None
    snapshots.take(Tracked(model, optimizer, None, {}), 1)  # the snapshots go on without it
    snapshots.close()
    assert _restored(store, model, optimizer) == 1


def test_plain_pickle_refuses_at_write_what_it_would_refuse_to_read():
    with pytest.raises(plain_pickle.Unkeepable, match="builtins.function"):
        plain_pickle.dumps({"f": lambda: None})
    with pytest.raises(plain_pickle.Unkeepable, match="numpy.ndarray"):
        plain_pickle.dumps(np.array([object()]))
    value = {"empty": torch.empty(0), "sizes": [torch.Size([1])], "kinds": {torch.float16}}
    loaded = plain_pickle.loads(plain_pickle.dumps(value))
    assert loaded["empty"].numel() == 0 and loaded["sizes"] == [torch.Size([1])] and loaded["kinds"] == {torch.float16}


class _FakeStream:
    def __init__(self, device: int, calls: list) -> None:
        self.device, self._calls = device, calls

    def wait_event(self, event: object) -> None:
        self._calls.append(("wait", self.device, event))

    def synchronize(self) -> None:
        self._calls.append(("synchronize", self.device))


def test_the_copy_runs_on_a_stream_of_the_gpu_that_queued_the_state():
    calls: list = []

    def make_stream(device: int) -> _FakeStream:
        calls.append(("stream", device))
        return _FakeStream(device, calls)

    @contextlib.contextmanager
    def on_stream(device: int, stream: _FakeStream):
        calls.append(("enter", device, stream.device))
        yield
        calls.append(("leave", device))

    copier = DeviceToHostCopier(make_stream, on_stream)
    for _ in range(2):
        assert copier.run(QueuedWork(3, "event"), lambda: calls.append(("copy",)) or "copied") == "copied"
    one_copy = [("enter", 3, 3), ("wait", 3, "event"), ("copy",), ("leave", 3), ("synchronize", 3)]
    assert calls == [("stream", 3), *one_copy, *one_copy]  # one stream, made for GPU 3, not the thread's GPU 0
    assert copier.run(None, lambda: "on the CPU") == "on the CPU"


def test_a_planted_link_is_refused_and_nothing_is_written_through_it(store, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store.parent.joinpath(store.name).symlink_to(elsewhere)
    with pytest.raises(UnsafeDirectory, match=r"is a link or not a directory; nothing was written: remove it"):
        _snapshots(store)
    assert not list(elsewhere.iterdir())


def test_a_folder_owned_by_another_user_is_refused(store):
    folder = memory_store.checkpointer_folder(store, "/ckpt")
    folder.mkdir(parents=True)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(UnsafeDirectory, match=rf"owned by uid {NOBODY}, not by this user"):
        _snapshots(store)
    assert not list(folder.iterdir())


def test_the_store_is_private_on_every_host(store):
    store.parent.chmod(0o755)  # made by someone's umask: closed to others when a rank opens it
    model, optimizer = _model_with_running_stats()
    snapshots = _snapshots(store)
    snapshots.take(Tracked(model, optimizer, None, {}), 0)
    snapshots.take(Tracked(model, optimizer, None, {}), 1)
    snapshots.close()
    folder = memory_store.checkpointer_folder(store, "/ckpt")
    for path in (store.parent, store, folder):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    files = sorted(folder.iterdir())
    assert {path.name for path in files} == {"board", "rank-00000.json", "rank-00000.slot0", "rank-00000.slot1",
                                             "rank-00000.slot0.state", "rank-00000.slot1.state"}
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files), files


def test_a_link_planted_for_the_state_file_is_not_followed(store, tmp_path):
    model, optimizer = _model_with_running_stats()
    snapshots = _snapshots(store)
    target = tmp_path / "victim"
    target.write_text("untouched")
    folder = memory_store.checkpointer_folder(store, "/ckpt")
    (folder / "rank-00000.slot1.state").symlink_to(target)
    (folder / "rank-00000.json").symlink_to(target)
    snapshots.take(Tracked(model, optimizer, None, {}), 0)
    snapshots.close()
    assert target.read_text() == "untouched"
    assert not (folder / "rank-00000.slot1.state").is_symlink() and not (folder / "rank-00000.json").is_symlink()
