"""Each rank's clock against the kernel's, for profiles of ranks on several hosts.

Ranks on the kernel's host share its clock. A rank on another host is asked for its Unix clock
(`ReportClock`) a few times; the answer was read between the send and the reply, so the rank's
offset is the midpoint of the round trip less its reading, off by at most half the round trip.
The round trip with the smallest such bound is kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fsdp2nb.pool.handle import PoolHandle
from fsdp2nb.wire.requests import ReportClock

if TYPE_CHECKING:
    from fsdp2nb.frontend.profiles import ProfileCollector

NUM_ROUND_TRIPS = 5
ANSWER_WAIT_S = 5.0
"""How long one round trip waits for the ranks' control threads."""

ClockOffsets = dict[int, tuple[int, int]]
"""rank -> (offset ns to add to its times, error bound ns)."""


def spans_hosts(pool: PoolHandle) -> bool:
    """Whether the pool's ranks run on other hosts (they name their cluster address then)."""
    return any(ready.address for ready in pool.ranks.values())


def estimate_offsets(pool: PoolHandle, next_request_id: Callable[[], int], collector: ProfileCollector) -> ClockOffsets:
    """Each answering rank's offset and its bound, from the best of a few round trips."""
    ranks = tuple(range(pool.world_size))
    best: ClockOffsets = {}
    for _ in range(NUM_ROUND_TRIPS):
        request_id = next_request_id()
        sent_ns = time.time_ns()
        pool.send(ranks, ReportClock(request_id=request_id), connect_timeout_s=0)
        for rank, (rank_ns, heard_ns) in collector.wait_for_clocks(request_id, ranks, ANSWER_WAIT_S).items():
            error = (heard_ns - sent_ns + 1) // 2
            if rank not in best or error < best[rank][1]:
                best[rank] = ((sent_ns + heard_ns) // 2 - rank_ns, error)
    return best
