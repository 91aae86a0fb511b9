"""A pulled DTensor arrives whole on the replying rank; the other ranks never hold it whole."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp2nb.worker.pulled_values import value_for_notebook
from tests.support.gloo_harness import run_ranks


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def _pull_on_ranks(shape: tuple[int, ...], placement: str, reply_ranks: tuple[int, ...]):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = {"rows": [Shard(0)], "columns": [Shard(1)], "replicated": [Replicate()]}[placement]
    sharded = distribute_tensor(_full(shape), mesh, placements)
    pulled = value_for_notebook(sharded, reply_ranks)
    return None if pulled is None else (type(pulled).__name__, pulled)


@pytest.mark.parametrize(("world_size", "shape", "placement"), [
    (2, (5, 3), "rows"),       # uneven: 3 and 2 rows
    (3, (4, 2), "rows"),       # 2, 2 and an empty shard
    (3, (2, 7), "columns"),
    (2, (3, 4), "replicated"),
])
def test_dtensor_is_gathered_to_the_replying_rank_only(world_size, shape, placement):
    reply = world_size - 1
    results = run_ranks(_pull_on_ranks, world_size, shape, placement, (reply,))
    for rank, result in enumerate(results):
        if placement == "replicated":  # already whole everywhere: nothing to gather
            assert torch.equal(result[1], _full(shape))
            continue
        if rank != reply:
            assert result is None
            continue
        kind, tensor = result
        assert kind == "Tensor"
        assert torch.equal(tensor, _full(shape))


def test_every_rank_gets_the_whole_dtensor_when_all_reply():
    results = run_ranks(_pull_on_ranks, 2, (5, 3), "rows", (0, 1))
    assert all(torch.equal(tensor, _full((5, 3))) for _, tensor in results)


def _pull_mixed():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # from_local without its check runs no collective, so rank 1 need not take part
    value = DTensor.from_local(torch.ones(2, 2), mesh, [Shard(0)], run_check=False) if dist.get_rank() == 0 \
        else torch.ones(2)
    try:
        value_for_notebook(value, (0,))
    except ValueError as error:
        return str(error)
    return None


def test_a_dtensor_on_some_ranks_only_fails_on_every_rank_instead_of_hanging():
    messages = run_ranks(_pull_mixed, 2)
    assert all(message and "DTensor on some ranks only" in message for message in messages)
