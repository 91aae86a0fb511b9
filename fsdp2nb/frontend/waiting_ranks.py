"""Whether a rank waits in a collective that cannot go on, read from the progress ranks report.

Positions alone cannot tell a loop of collectives from a hang: a healthy loop sampled twice can
show one rank "in all_reduce at line 6" both times while another computes at line 7, exactly as a
rank hung in a collective that the other never enters. So each rank of a CPU pool counts the
collectives it has entered (`worker/collective_count.py`) and sends the count with every sample.
A rank is stalled when it sits in a collective and its count has not moved across samples that
span `STALLED_AFTER_S` of its own clock (the kernel's asks can arrive late on a busy machine; the
rank's clock says how far apart its samples really were). A stalled rank waits when another rank
is elsewhere or ahead: not in the same collective at the same count, or not running the cell at
all. Ranks all stalled in the same collective at the same count are in one slow collective.
Where ranks do not count (NCCL pools), `rank_waits` says so and the caller compares positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2nb.wire.events import RankActivity

STALLED_AFTER_S = 1.5
"""How long, by a rank's own clock between its samples, a count must stay the same for the rank
to be stalled. Under the kernel's 2 s between asks, so that a real hang shows at the second."""


@dataclass(frozen=True, slots=True)
class CountSeen:
    """A rank's count of collectives entered, and its clock at the first sample that showed it."""

    num_collectives: int
    since: float


class CollectiveCounts:
    """Each rank's count as first seen: what a later sample is compared with."""

    def __init__(self) -> None:
        self._seen: dict[int, CountSeen] = {}

    def note(self, activity: RankActivity) -> bool:
        """Record a sample; True when its count differs from the one seen before (a new collective)."""
        if activity.num_collectives is None:
            return False
        seen = self._seen.get(activity.rank)
        if seen is not None and seen.num_collectives == activity.num_collectives:
            return False
        self._seen[activity.rank] = CountSeen(activity.num_collectives, activity.sampled_at)
        return seen is not None

    def stalled(self, activity: RankActivity) -> bool:
        """In a collective, and its count the same for at least STALLED_AFTER_S of samples."""
        seen = self._seen.get(activity.rank)
        return (bool(activity.collective) and seen is not None
                and seen.num_collectives == activity.num_collectives
                and activity.sampled_at - seen.since >= STALLED_AFTER_S)


def rank_waits(running: list[int], activity: dict[int, RankActivity], counts: CollectiveCounts, *,
               all_ranks_run: bool) -> bool | None:
    """Whether a running rank waits in a collective that others are not in, read from counts;
    None where a running rank has no sample yet or does not count its collectives.
    `all_ranks_run`: False where the cell runs on some ranks only (`--ranks`)."""
    samples = [activity.get(rank) for rank in running]
    if any(sample is None or sample.num_collectives is None for sample in samples):
        return None
    present = [sample for sample in samples if sample is not None]
    for sample in present:
        if not counts.stalled(sample):
            continue
        if not all_ranks_run:
            return True  # the ranks left out never enter it
        if any(_elsewhere_or_ahead(other, sample) for other in present if other.rank != sample.rank):
            return True
    return False


def _elsewhere_or_ahead(other: RankActivity, stalled: RankActivity) -> bool:
    """Whether `other` is not in the collective `stalled` waits in: computing, in another one, or
    past it (or not yet at it) by its count."""
    return (other.collective, other.num_collectives) != (stalled.collective, stalled.num_collectives)
