import torch
import torch.distributed as dist

from tests.support.gloo_harness import run_ranks


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_all_reduce_on_two_ranks():
    assert run_ranks(_sum_of_ranks, 2) == [1.0, 1.0]
