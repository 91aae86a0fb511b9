"""Which process a pid names, now and later: (pid, start time), the start counted from boot.

psutil's `create_time()` adds the boot time, which Linux recomputes on every read as the wall
clock minus the uptime (`btime` in /proc/stat): when the clock is stepped or slewed across a
second it moves by one, and a process recorded before no longer matches itself. A live rank
would be taken for dead and its pool restarted, a live kernel's memory store swept. The start in
clock ticks after boot (/proc/PID/stat, field 22) never changes, and a reused pid starts later.
"""

from __future__ import annotations

import os

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_START_FIELD = 19
"""starttime's index among the fields after the command name, which ends at the last ')' (the
name may hold spaces and parentheses): field 22 of proc(5), counting the pid and name."""

ProcessKey = tuple[int, float]
"""(pid, start time in seconds after boot): one process, never another that reuses the pid."""


def start_time(pid: int) -> float | None:
    """When process `pid` started, in seconds after boot; None where no such process exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[_START_FIELD]) / _CLOCK_TICKS


def process_key(pid: int) -> ProcessKey | None:
    """The key of the process `pid` names now; None where none does."""
    started = start_time(pid)
    return None if started is None else (pid, started)


def own_process_key() -> ProcessKey:
    """This process's key."""
    key = process_key(os.getpid())
    assert key is not None, "a process can always read its own /proc entry"
    return key


def is_same_process(key: ProcessKey) -> bool:
    """Whether the pid of `key` still names the process it named (alive or a zombie). Starts
    are whole clock ticks; half a tick of slack covers a start kept in milliseconds."""
    pid, started = key
    now_started = start_time(pid)
    return now_started is not None and abs(now_started - started) < 0.5 / _CLOCK_TICKS
