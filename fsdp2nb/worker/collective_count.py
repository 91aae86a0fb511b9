"""How many collectives this rank's main thread has entered: the progress a stack sample cannot see.

Two stack samples of a rank in a loop of collectives and of a rank hung in one can look the same
(both "in all_reduce at line 6"); the count tells them apart, since a rank that moves on enters
the next collective. The groups of a CPU pool (`worker/reformable_groups.py`) call
`note_entered` for every operation that talks to peers; the control thread reads the count when
the kernel asks where the rank is (`ReportActivity`). An NCCL pool's groups are torch's own and
are not counted: there the kernel falls back to comparing positions.

Only the main thread's collectives count, as only its stack is sampled: a checkpointer's save
thread talking over its own group would otherwise move the count while the cell hangs. The hot
path is a thread id compared and an integer incremented by that one thread: no lock.
"""

from __future__ import annotations

import os
import threading

_main_thread_id = threading.main_thread().ident
"""The thread that runs cells: a rank's main thread, the one its agent's fork left it."""
_num_entered = 0


def _after_fork() -> None:
    """A forked rank (the agent forks each) counts from zero on the thread that forked, its only one."""
    global _main_thread_id, _num_entered
    _main_thread_id, _num_entered = threading.get_ident(), 0


os.register_at_fork(after_in_child=_after_fork)


def note_entered() -> None:
    """One more collective entered, if by the main thread (called as it starts, before it can block)."""
    global _num_entered
    if threading.get_ident() == _main_thread_id:
        _num_entered += 1


def num_entered() -> int:
    """How many collectives the main thread has entered since the rank started."""
    return _num_entered
