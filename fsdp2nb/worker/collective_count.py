"""How many collectives this rank has entered: the progress a stack sample cannot see.

Two stack samples of a rank in a loop of collectives and of a rank hung in one can look the same
(both "in all_reduce at line 6"); the count tells them apart, since a rank that moves on enters
the next collective. The groups of a CPU pool (`worker/reformable_groups.py`) call
`note_entered` for every operation that talks to peers; the control thread reads the count when
the kernel asks where the rank is (`ReportActivity`). An NCCL pool's groups are torch's own and
are not counted: there the kernel falls back to comparing positions.

The hot path is one integer increment under the GIL: no lock. An increment lost to a race with
another thread would only make the count lag, and a lagging count still moves.
"""

from __future__ import annotations

_num_entered = 0


def note_entered() -> None:
    """One more collective entered (called as it starts, before it can block)."""
    global _num_entered
    _num_entered += 1


def num_entered() -> int:
    """How many collectives this rank has entered since it started."""
    return _num_entered
