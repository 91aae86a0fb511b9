"""A release that reaches a rank after the re-forming that follows it cuts nothing new.

The kernel sends `ReleaseCollectives` on the control channel and `ReformGroups` on the main one;
on a busy rank the control thread can read the release late. On 2 gloo ranks: the re-forming
waits for the release it names, and one that never came in time is dropped when it does come, so
the fresh connections carry the next collective either way.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from fsdp2nb.worker import reformable_groups
from tests.support.gloo_harness import run_ranks


def _reform_while_the_release_is_late(release_after_s: float, wait_s: float) -> tuple[float, int]:
    reformable_groups.register_backend()
    reformable_groups.RELEASE_ARRIVAL_WAIT_S = wait_s
    group = dist.new_group([0, 1], backend=reformable_groups.BACKEND_NAME)
    before = torch.ones(1)
    dist.all_reduce(before, group=group)  # connected
    cuts = []
    late = threading.Timer(release_after_s, lambda: cuts.append(reformable_groups.release_collectives(7)))
    late.start()
    reformable_groups.reform_groups(generation=1, after_release=7)
    late.join()
    after = torch.ones(1)
    dist.all_reduce(after, group=group)
    return after.item(), cuts[0]


def test_the_re_forming_waits_for_the_release_it_follows():
    results = run_ranks(_reform_while_the_release_is_late, 2, 0.5, 30.0)
    assert [total for total, _ in results] == [2.0, 2.0]
    assert sum(cut for _, cut in results) > 0, results  # the old connection was cut (by the rank first there)


def test_a_release_later_than_the_wait_is_dropped():
    results = run_ranks(_reform_while_the_release_is_late, 2, 1.0, 0.2)
    assert results == [(2.0, 0), (2.0, 0)]
