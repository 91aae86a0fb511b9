"""A backward that fails after some units reduced their gradients: once the failed iteration is
reset (as a failed cell resets it), the next step trains exactly as if the failed one never ran."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp2nb.engine import fsdp_internals
from fsdp2nb.engine.failed_iteration import reset_failed_iterations
from tests.support.gloo_harness import run_ranks


class FailInBackward(torch.autograd.Function):
    """Identity forward; its backward raises while `armed`."""

    armed = False

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if FailInBackward.armed:
            raise RuntimeError("backward failed on purpose")
        return grad


class ThreeBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks[0](inputs)
        hidden = FailInBackward.apply(hidden)  # backward reaches here after blocks 2 and 1 reduced theirs
        return self.blocks[2](self.blocks[1](hidden))


def _sharded_model_and_optimizer() -> tuple[ThreeBlocks, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ThreeBlocks()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    model(inputs).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _step_after_a_failed_backward_and_a_clean_step() -> dict:
    inputs = torch.arange(8.0).reshape(2, 4) + dist.get_rank()
    model, optimizer = _sharded_model_and_optimizer()
    FailInBackward.armed = True
    try:
        model(inputs * 3).square().sum().backward()
        raise AssertionError("the backward did not fail")
    except RuntimeError as failure:
        assert "on purpose" in str(failure)
    finally:
        FailInBackward.armed = False
    cut_short = fsdp_internals.backward_cut_short(model)
    reduced_before_failure = [p.grad is not None for p in model.parameters()]
    assert reset_failed_iterations([model]) == 1
    _train_step(model, optimizer, inputs)

    clean, clean_optimizer = _sharded_model_and_optimizer()
    _train_step(clean, clean_optimizer, inputs)
    return {
        "cut_short": cut_short,
        "some_reduced": any(reduced_before_failure),
        "same_as_clean": all(torch.equal(a.to_local(), b.to_local())
                             for a, b in zip(model.parameters(), clean.parameters(), strict=True)),
    }


def test_the_step_after_a_failed_backward_adds_nothing_of_the_failed_one():
    for result in run_ranks(_step_after_a_failed_backward_and_a_clean_step, 2):
        assert result == {"cut_short": True, "some_reduced": True, "same_as_clean": True}
