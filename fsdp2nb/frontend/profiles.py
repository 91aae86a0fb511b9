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
from collections.abc import Callable, Collection
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


class PendingProfile:
    """A profiled cell's profile, which its ranks send after their replies: complete once every
    rank's has come, or short of the ranks that died first (`missing`)."""

    def __init__(self, cell_id: int, ranks: tuple[int, ...]) -> None:
        self.cell_id = cell_id
        self.ranks = ranks
        self.arrived: dict[int, RankProfile] = {}
        self.missing: tuple[int, ...] = ()
        """Ranks whose profile will not come (they exited before sending it)."""
        self.clock_offsets: dict[int, tuple[int, int]] | None = None
        """rank -> its clock's offset and bound (ns), for ranks on other hosts."""
        self.done = threading.Event()
        self.profile: Profile | None = None
        """What arrived, once done (None when no rank's did)."""

    @property
    def complete(self) -> bool:
        return set(self.ranks) <= set(self.arrived)

    def note(self) -> str:
        """Lines under the view for ranks whose profile did not come or failed; "" when all came."""
        lines = [f"the profile is missing for rank {rank}: {self.arrived[rank].failure}"
                 for rank in self.ranks if rank in self.arrived and self.arrived[rank].failure]
        if self.missing:
            ranks = ", ".join(str(rank) for rank in self.missing)
            lines.insert(0, f"the profile is missing for rank{'s' if len(self.missing) > 1 else ''} {ranks}: "
                            "it exited (or its pool stopped) before sending it")
        return "\n".join(lines)


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
        self._pending: dict[int, PendingProfile] = {}
        """cell id -> the profiled cell whose ranks send their profiles after their replies."""
        self._deferred: set[int] = set()
        """Every cell id ever expected: their profiles are never shown under another cell."""
        self.last: Profile | None = None

    def hear(self, event: object) -> None:
        """A pool listener: keeps profiles and stacks, ignores everything else."""
        if isinstance(event, RankProfile):
            with self._lock:
                pending = self._pending.get(event.cell_id) if event.cell_id is not None else None
                if pending is not None and not pending.done.is_set():
                    pending.arrived[event.rank] = event
                elif event.cell_id not in self._deferred:  # one that came after its cell gave up is dropped
                    self._arrived.append(event)
                self._lock.notify_all()
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
        arrived = _on_common_clock(arrived, clock_offsets)
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

    def expect(self, cell_id: int, ranks: tuple[int, ...]) -> PendingProfile:
        """The profile of cell `cell_id`, which its ranks send after their replies (`%%fsdp2 --profile`)."""
        pending = PendingProfile(cell_id, ranks)
        with self._lock:
            self._pending[cell_id] = pending
            self._deferred.add(cell_id)
            for event in [event for event in self._arrived if event.cell_id == cell_id]:  # came before this call
                self._arrived.remove(event)
                pending.arrived[event.rank] = event
        return pending

    def wait_for(self, pending: PendingProfile, exited: Callable[[], Collection[int]], poll_s: float = 0.5) -> None:
        """Until every rank's profile came or the ranks yet to send one have exited (`exited`:
        the pool's exited ranks, looked at every `poll_s`: an exit is no event of this listener)."""
        try:
            with self._lock:
                while not pending.complete:
                    gone = set(exited())
                    if gone and not set(pending.ranks) - gone - set(pending.arrived):
                        break
                    self._lock.wait(poll_s)
                pending.missing = tuple(rank for rank in pending.ranks if rank not in pending.arrived)
                arrived = [pending.arrived[rank] for rank in pending.ranks
                           if rank in pending.arrived and not pending.arrived[rank].failure]
            if arrived:
                pending.profile = Profile(_on_common_clock(arrived, pending.clock_offsets), self._directory())
                with self._lock:
                    self.last = pending.profile
        finally:
            with self._lock:
                self._pending.pop(pending.cell_id, None)
            pending.done.set()

    def wait_for_pending(self) -> None:
        """Until the profiles cells are waiting for have come (or will not)."""
        with self._lock:
            pending = list(self._pending.values())
        for each in pending:
            each.done.wait()

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


def _on_common_clock(profiles: list[RankProfile], clock_offsets: dict[int, tuple[int, int]] | None) -> list[RankProfile]:
    if not clock_offsets:
        return profiles
    return [replace(profile, clock_offset_ns=clock_offsets[profile.rank][0], clock_error_ns=clock_offsets[profile.rank][1])
            if profile.rank in clock_offsets else profile for profile in profiles]


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
