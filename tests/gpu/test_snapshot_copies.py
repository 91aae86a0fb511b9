"""GPU-to-host copies of async saves and snapshots in host memory: on a side stream of the GPU
that holds the state (the last one here, not GPU 0), whole once the copy returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp2nb.checkpoint.host_copy import DeviceToHostCopier, queued_work_of
from fsdp2nb.checkpoint.memory_snapshots import MemorySnapshots
from fsdp2nb.checkpoint.rank_file import Tracked
from fsdp2nb.host import memory_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
]


def _last_gpu() -> int:
    return torch.cuda.device_count() - 1


def test_the_copy_waits_for_the_queued_work_on_the_gpu_that_queued_it():
    device = _last_gpu()
    streams: list[int] = []
    copier = DeviceToHostCopier(make_stream=lambda index: streams.append(index) or torch.cuda.Stream(device=index))
    with torch.cuda.device(device):
        source = torch.zeros(1 << 22, device=f"cuda:{device}")
        source.add_(1).mul_(3)  # queued, maybe not run yet
        queued = queued_work_of([source])
    target = torch.empty(source.shape, pin_memory=True)
    copier.run(queued, lambda: target.copy_(source, non_blocking=True))
    assert queued is not None and queued.device == device and streams == [device]
    assert torch.all(target == 3)


def test_a_snapshot_of_a_model_on_a_gpu_restores_bitwise(tmp_path: Path):
    device = torch.device("cuda", _last_gpu())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(16, 64, device=device)).sum().backward()
    optimizer.step()
    store = tmp_path / "shm" / "session-1-1"
    folder = memory_store.open_checkpointer_folder(store, "/ckpt")
    snapshots = MemorySnapshots(folder, Path("/ckpt"), rank=0, world_size=1, local_ranks=range(1), group=None)
    tracked = Tracked(model, optimizer, None, {})
    snapshots.take(tracked, 0)
    expected = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    model(torch.randn(16, 64, device=device) + 5)  # running statistics change while the copy runs
    snapshots.wait()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    step = snapshots.agreed_step()
    assert step == 0
    snapshots.restore(tracked, step)
    snapshots.close()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
