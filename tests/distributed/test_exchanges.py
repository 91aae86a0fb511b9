"""`collectives.all_gathered` and `all_gathered_objects` on gloo ranks: every rank's value in rank
order, on the default group and on a group whose first rank is not rank 0."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp2nb.collectives import all_gathered, all_gathered_objects, gathered_if_all_succeeded
from tests.support.gloo_harness import run_ranks


def _exchange_everywhere():
    rank = dist.get_rank()
    everyone = all_gathered(torch.tensor([rank, 10 * rank], dtype=torch.int64)).tolist()
    values = all_gathered_objects({"rank": rank, "text": "x" * rank * 40})  # payloads of different sizes
    upper = dist.new_group([1, 2])  # its first rank is global rank 1
    in_upper = None
    if rank in (1, 2):
        in_upper = (all_gathered(torch.tensor([float(rank)]), upper).tolist(), all_gathered_objects(rank, upper),
                    gathered_if_all_succeeded(rank * rank, None, "a step", upper))
    dist.barrier()
    return everyone, values, in_upper


def test_every_rank_gets_every_value_in_rank_order():
    results = run_ranks(_exchange_everywhere, 3)
    for rank, (everyone, values, in_upper) in enumerate(results):
        assert everyone == [[0, 0], [1, 10], [2, 20]], rank
        assert values == [{"rank": other, "text": "x" * other * 40} for other in range(3)], rank
        assert in_upper == (None if rank == 0 else ([[1.0], [2.0]], [1, 2], [1, 4])), rank
