"""The split of what a rank holds (parameters, gradients, optimizer state) is read again after an
optimizer step, at most once per interval, on the thread that stepped: a training cell's panel
shows gradients and optimizer state from its first step on, not "0 B" until the cell ends."""

from __future__ import annotations

import threading

import torch

from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.worker.sampler import ResourceSampler

INTERVAL_S = 2.0


class _Clock:
    """A clock the test moves by hand, so the rate limit is checked without waiting."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sampler(clock: _Clock) -> ResourceSampler:
    return ResourceSampler(rank=1, device="cpu", send=lambda snapshot: None, is_busy=lambda: True,
                           step_refresh_interval_s=INTERVAL_S, clock=clock)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()


def _split(sampler: ResourceSampler) -> tuple[int, int, int]:
    snapshot = sampler.sample()
    return snapshot.param_bytes, snapshot.grad_bytes, snapshot.optimizer_bytes


def test_a_step_reads_the_split_again_at_most_once_per_interval(tmp_path):
    model = torch.nn.Linear(4, 4)  # 20 float32 values: 80 bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    clock = _Clock()
    sampler = _sampler(clock)
    with Checkpointer(tmp_path, async_save=False).track(model=model, optimizer=optimizer):
        sampler.refresh_tracked_sizes()  # as between cells: nothing has stepped yet
        assert _split(sampler) == (80, 0, 0)
        sampler.watch_optimizer_steps()
        try:
            _train_step(model, optimizer)
            assert _split(sampler) == (80, 80, 80)  # gradients and momentum buffers, with no refresh called
            optimizer.zero_grad()
            model.bias.requires_grad_(False)  # what trains changes: the next reading differs
            clock.now += INTERVAL_S / 2
            _train_step(model, optimizer)
            assert _split(sampler) == (80, 80, 80)  # within the interval: the last reading stands
            clock.now += INTERVAL_S
            _train_step(model, optimizer)
            assert _split(sampler) == (80, 64, 80)
        finally:
            sampler.stop()
        optimizer.zero_grad()
        model.bias.requires_grad_(True)
        clock.now += 10 * INTERVAL_S
        _train_step(model, optimizer)
        assert _split(sampler) == (80, 64, 80)  # stopped: its hook is gone, the change is not read


def test_the_step_reads_on_the_thread_that_stepped(tmp_path):
    readers: list[str] = []
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = _sampler(_Clock())
    original = sampler.refresh_tracked_sizes
    sampler.refresh_tracked_sizes = lambda: (readers.append(threading.current_thread().name), original())[1]
    with Checkpointer(tmp_path, async_save=False).track(model=model, optimizer=optimizer):
        sampler.watch_optimizer_steps()
        try:
            thread = threading.Thread(target=_train_step, args=(model, optimizer), name="training-thread")
            thread.start()
            thread.join()
        finally:
            sampler.stop()
    assert readers == ["training-thread"]
    assert _split(sampler)[1] == 80
