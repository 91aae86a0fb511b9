"""fsdp2nb.log on a rank: points wait for the sampler, bounded, as plain floats."""

import pytest

from fsdp2nb.worker.metrics import MetricsBuffer, log, process_metrics
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
        assert sizes.read() == dict(param_bytes=80, grad_bytes=0, optimizer_bytes=0)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        assert sizes.read(busy=True) == dict(param_bytes=80, grad_bytes=80, optimizer_bytes=80)  # momentum buffers
        optimizer.zero_grad()
        assert sizes.read(busy=True)["grad_bytes"] == 0
    assert TrackedSizes().read() == {}  # closed: nothing tracked


def test_tracked_sizes_do_no_per_parameter_work_while_a_cell_runs(tmp_path, monkeypatch):
    import torch

    from fsdp2nb.checkpoint import Checkpointer
    from fsdp2nb.worker import sampler

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(8)))
    optimizer = torch.optim.AdamW(model.parameters())
    measured: list[int] = []
    real_local_bytes = sampler._local_bytes
    monkeypatch.setattr(sampler, "_local_bytes", lambda tensors: measured.append(len(tensors)) or real_local_bytes(tensors))
    with Checkpointer(tmp_path, async_save=False).track(model=model, optimizer=optimizer):
        sizes = sampler.TrackedSizes()
        sizes.read(busy=True)  # a new model: read once
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        sizes.read(busy=True)  # the first step made the optimizer state: read once
        measured.clear()
        for _ in range(20):
            optimizer.zero_grad()
            assert sizes.read(busy=True)["grad_bytes"] == 0
            model(torch.ones(2, 4)).sum().backward()
            assert sizes.read(busy=True)["grad_bytes"] == 8 * 80
        assert measured == []
        sizes.read(busy=False)  # the cell ended: everything once more
        sizes.read(busy=False)
        assert len(measured) == 3  # parameters, trainable parameters, optimizer state
