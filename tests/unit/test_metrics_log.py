"""fsdp2nb.log on a rank: points wait for the sampler, bounded, as plain floats."""

import pytest

from fsdp2nb.metrics import MetricsBuffer, log, process_metrics
from fsdp2nb.worker.sampler import ResourceSampler


def test_drain_returns_points_once_in_order():
    buffer = MetricsBuffer()
    buffer.log(1, {"loss": 2.5})
    buffer.log(2, {"loss": 2.0, "lr": 1e-3})
    points = buffer.drain()
    assert [(p.step, p.values) for p in points] == [(1, {"loss": 2.5}), (2, {"loss": 2.0, "lr": 1e-3})]
    assert buffer.drain() == ()


def test_buffer_keeps_the_newest_points_when_full():
    buffer = MetricsBuffer(max_points=3)
    for step in range(10):
        buffer.log(step, {"loss": float(step)})
    assert [p.step for p in buffer.drain()] == [7, 8, 9]


def test_tensor_values_arrive_as_floats():
    import torch

    buffer = MetricsBuffer()
    buffer.log(3, {"loss": torch.tensor(1.5)})
    (point,) = buffer.drain()
    assert type(point.values["loss"]) is float and point.values["loss"] == 1.5


def test_log_rejects_a_step_that_is_not_an_int():
    with pytest.raises(ValueError, match="step="):
        log("three", loss=1.0)


def test_sampler_sends_logged_points_with_the_next_snapshot():
    process_metrics().drain()
    log(5, loss=0.25)
    sampler = ResourceSampler(rank=1, device="cpu", send=lambda snapshot: None, is_busy=lambda: True)
    snapshot = sampler.sample()
    assert [(p.step, p.values) for p in snapshot.metrics] == [(5, {"loss": 0.25})]
    assert snapshot.rss_peak_bytes >= snapshot.rss_bytes > 0
    assert sampler.sample().metrics == ()


def test_reset_peak_starts_the_rss_peak_afresh():
    sampler = ResourceSampler(rank=1, device="cpu", send=lambda snapshot: None, is_busy=lambda: False)
    sampler._rss_peak = 1 << 50  # a peak far above any real RSS
    sampler.reset_peak()
    assert sampler.sample().rss_peak_bytes < 1 << 50


def test_tracked_sizes_count_params_grads_and_optimizer_state(tmp_path):
    import torch

    from fsdp2nb.checkpoint import Checkpointer
    from fsdp2nb.worker.sampler import TrackedSizes

    model = torch.nn.Linear(4, 4)  # 20 float32 values: 80 bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Checkpointer(tmp_path, async_save=False).track(model=model, optimizer=optimizer):
        sizes = TrackedSizes()
        sizes.refresh()
        assert sizes.read() == dict(param_bytes=80, grad_bytes=0, optimizer_bytes=0)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        assert sizes.read()["grad_bytes"] == 0  # what the last refresh saw, until the next
        sizes.refresh()
        assert sizes.read() == dict(param_bytes=80, grad_bytes=80, optimizer_bytes=80)  # momentum buffers
        optimizer.zero_grad()
        sizes.refresh()
        assert sizes.read()["grad_bytes"] == 0
        model.bias.requires_grad_(False)  # what trains changed: read again
        model(torch.ones(2, 4)).sum().backward()
        sizes.refresh()
        assert sizes.read() == dict(param_bytes=80, grad_bytes=64, optimizer_bytes=80)
    sizes.refresh()
    assert sizes.read() == {}  # closed: nothing tracked


class _WatchedParameter:
    """Stands in for a parameter; records the threads that read its gradient."""

    requires_grad = True

    def __init__(self, readers: list[str]) -> None:
        self._readers = readers

    @property
    def grad(self):  # mirrors torch's
        import threading

        self._readers.append(threading.current_thread().name)
        return None

    def numel(self) -> int:
        return 4

    def untyped_storage(self):  # mirrors torch's: the 16 bytes behind the parameter
        from types import SimpleNamespace

        return SimpleNamespace(data_ptr=lambda: id(self), nbytes=lambda: 16)

    def element_size(self) -> int:
        return 4


def test_the_sampler_thread_never_touches_the_tracked_model(tmp_path):
    """A thread reading `.grad` while FSDP2 trains crashes the rank (see TrackedSizes): while a
    cell runs, every snapshot must come from what the main thread read between requests."""
    import threading

    import torch

    from fsdp2nb.checkpoint import Checkpointer

    readers: list[str] = []
    parameter = _WatchedParameter(readers)
    model = torch.nn.Module()
    model.parameters = lambda recurse=True: iter([parameter])
    sampler = ResourceSampler(rank=1, device="cpu", send=lambda snapshot: None, is_busy=lambda: True)
    with Checkpointer(tmp_path, async_save=False).track(model=model):
        sampler.refresh_tracked_sizes()
        assert readers == [threading.current_thread().name]
        snapshots = []
        thread = threading.Thread(target=lambda: snapshots.extend(sampler.sample() for _ in range(5)),
                                  name="sampler-under-test")
        thread.start()
        thread.join()
    assert readers == [threading.current_thread().name]  # nothing more, from no other thread
    assert {s.param_bytes for s in snapshots} == {16} and {s.grad_bytes for s in snapshots} == {0}


def test_a_failed_size_reading_is_logged_once_and_keeps_the_rank(tmp_path, caplog):
    import torch

    from fsdp2nb.checkpoint import Checkpointer

    model = torch.nn.Module()
    model.parameters = lambda recurse=True: (_ for _ in ()).throw(RuntimeError("no parameters today"))
    sampler = ResourceSampler(rank=1, device="cpu", send=lambda snapshot: None, is_busy=lambda: False)
    with Checkpointer(tmp_path, async_save=False).track(model=model):
        sampler.refresh_tracked_sizes()
        sampler.refresh_tracked_sizes()
    failures = [r for r in caplog.records if "reading the tracked model's sizes failed" in r.getMessage()]
    assert len(failures) == 1
