"""The kernel's side of profiles and stacks: the ranks' `RankProfile` and `RankStacks` events,
heard as they arrive (a pool listener), and what the notebook gets of them: a `Profile` after a
profiled cell (`%fsdp2 profile` returns the last) and the ranks' stacks (`%fsdp2 stacks`)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import replace

from fsdp2nb.frontend.profile_view import render_html, render_text
from fsdp2nb.profile_analysis import ProfileAnalysis, RankRow, TopOp, analyse, merged_trace
from fsdp2nb.wire.events import RankClock, RankProfile, RankStacks


class Profile:
    """One profiled cell (or `fsdp2nb.profile()` block) over its ranks; shows as its table and timeline."""

    def __init__(self, profiles: list[RankProfile], trace_dir: str) -> None:
        self.analysis: ProfileAnalysis = analyse(profiles)
        self._profiles = profiles
        self._trace_dir = trace_dir
        self._trace_path: str | None = None

    @property
    def ranks(self) -> tuple[RankRow, ...]:
        """One row per rank: `rank`, `wall_s`, `compute_s`, `communication_s`, `waiting_s`, `idle_s`."""
        return self.analysis.rows

    @property
    def straggler(self) -> int | None:
        """The rank the others waited for most; None when no rank waited."""
        return self.analysis.straggler

    @property
    def top_ops(self) -> tuple[TopOp, ...]:
        return self.analysis.top_ops

    @property
    def clocks(self) -> dict[int, tuple[float, float]]:
        """rank -> (offset added to its times, how far it may be off), in seconds: 0 on the kernel's host."""
        return {p.rank: (p.clock_offset_ns / 1e9, p.clock_error_ns / 1e9) for p in self._profiles}

    @property
    def trace_path(self) -> str:
        """One Chrome/Perfetto JSON trace of every rank (a process each) on one clock, written on
        first use: open it in ui.perfetto.dev."""
        if self._trace_path is None:
            cell = self.analysis.cell_id if self.analysis.cell_id is not None else "block"
            path = os.path.join(self._trace_dir, f"profile-{cell}-{id(self):x}.json")
            with open(path, "w") as file:
                json.dump(merged_trace(self._profiles), file)
            self._trace_path = path
        return self._trace_path

    @property
    def rank_profiles(self) -> tuple[RankProfile, ...]:
        """What each rank sent, its ops packed (fsdp2nb/profile_records.py)."""
        return tuple(self._profiles)

    def hta(self) -> dict:
        """GPU ranks: Holistic Trace Analysis's temporal breakdown and communication/compute
        overlap (`{"temporal": DataFrame, "overlap": DataFrame}`); needs `fsdp2nb[profile]`."""
        from fsdp2nb.frontend.profile_hta import hta_breakdown

        return hta_breakdown(self.rank_profiles)

    def _repr_html_(self) -> str:
        return render_html(self.analysis)

    def __repr__(self) -> str:
        return render_text(self.analysis)


class ProfileCollector:
    """Hears the ranks' profiles and stacks on the thread that reads their events."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._arrived: list[RankProfile] = []
        """Profiles not yet made into a `Profile`, in arrival order."""
        self._stacks: dict[int, dict[int, RankStacks]] = defaultdict(dict)
        self._clocks: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
        """request id -> rank -> (the rank's clock, this kernel's clock when the answer was heard)."""
        self._trace_dir: str | None = None
        self.last: Profile | None = None

    def hear(self, event: object) -> None:
        """A pool listener: keeps profiles and stacks, ignores everything else."""
        if isinstance(event, RankProfile):
            with self._lock:
                self._arrived.append(event)
        elif isinstance(event, RankStacks):
            with self._lock:
                self._stacks[event.request_id][event.rank] = event
                self._lock.notify_all()
        elif isinstance(event, RankClock):
            heard_ns = time.time_ns()
            with self._lock:
                self._clocks[event.request_id][event.rank] = (event.unix_ns, heard_ns)
                self._lock.notify_all()

    def take_new(self, clock_offsets: dict[int, tuple[int, int]] | None = None) -> list[Profile]:
        """The profiles whose events came since the last take, one per cell or block, in order;
        `clock_offsets` (rank -> offset and bound, ns) puts ranks of other hosts on this clock."""
        with self._lock:
            arrived, self._arrived = self._arrived, []
        if clock_offsets:
            arrived = [replace(profile, clock_offset_ns=clock_offsets[profile.rank][0],
                               clock_error_ns=clock_offsets[profile.rank][1])
                       if profile.rank in clock_offsets else profile for profile in arrived]
        groups: dict[tuple[int | None, int], list[RankProfile]] = {}
        count: dict[tuple[int | None, int], int] = defaultdict(int)
        for profile in arrived:  # a cell with several profile() blocks sends each rank's in order
            nth = count[(profile.cell_id, profile.rank)]
            count[(profile.cell_id, profile.rank)] += 1
            groups.setdefault((profile.cell_id, nth), []).append(profile)
        made = [Profile(group, self._directory()) for group in groups.values()]
        if made:
            self.last = made[-1]
        return made

    def has_new(self) -> bool:
        """Whether profiles came since the last take."""
        with self._lock:
            return bool(self._arrived)

    def wait_for_stacks(self, request_id: int, ranks: tuple[int, ...], timeout_s: float) -> dict[int, RankStacks]:
        """The stacks the ranks sent for `request_id`, once all came or `timeout_s` passed."""
        with self._lock:
            self._lock.wait_for(lambda: set(ranks) <= set(self._stacks[request_id]), timeout_s)
            return self._stacks.pop(request_id, {})

    def wait_for_clocks(self, request_id: int, ranks: tuple[int, ...], timeout_s: float) -> dict[int, tuple[int, int]]:
        """rank -> (its clock, this kernel's when heard) for `request_id`, once all came or `timeout_s` passed."""
        with self._lock:
            self._lock.wait_for(lambda: set(ranks) <= set(self._clocks[request_id]), timeout_s)
            return self._clocks.pop(request_id, {})

    def _directory(self) -> str:
        if self._trace_dir is None:
            self._trace_dir = tempfile.mkdtemp(prefix="fsdp2nb-profiles-")  # 0700: this user's
        return self._trace_dir


def describe_stacks(stacks: dict[int, RankStacks], world_size: int) -> str:
    """Every rank's threads, labelled by rank; a main thread in a cell from the cell's frame on."""
    lines = []
    for rank in range(world_size):
        if rank not in stacks:
            lines.append(f"[{rank}] did not answer (its control thread is busy or the rank is gone)")
            continue
        state = "between cells" if stacks[rank].cell_id is None else "running a request"
        lines.append(f"[{rank}] {state}")
        for thread in stacks[rank].threads:
            if thread.name.startswith(_OWN_THREAD_PREFIX) and thread.frames:  # fsdp2nb's own: where it waits
                lines.append(f"[{rank}]   thread {thread.name}: {thread.frames[-1]}")
                continue
            lines.append(f"[{rank}]   thread {thread.name}{' (runs cells)' if thread.main else ''}:")
            lines.extend(f"[{rank}]     {frame}" for frame in _from_cell_on(thread.frames))
    return "\n".join(lines)


_OWN_THREAD_PREFIX = "fsdp2nb-"
"""fsdp2nb's threads on a rank (output capture, sampler, control) are named so."""
_THREAD_START = ("threading.py:",)


def _from_cell_on(frames: tuple[str, ...]) -> list[str]:
    """A thread's frames from its first cell frame on (the rank's own loop above it left out)."""
    first_cell = next((index for index, frame in enumerate(frames) if frame.startswith("In[")), None)
    if first_cell is None:  # a thread's own start (threading.py's bootstrap) says nothing
        return [frame for index, frame in enumerate(frames)
                if not (frame.startswith(_THREAD_START) and all(f.startswith(_THREAD_START) for f in frames[:index]))]
    return [f"... {first_cell} frames of the rank's request loop", *frames[first_cell:]]
