"""Where a profiled cell's time went on each rank, from the ranks' `RankProfile` events (no torch).

Every rank's time is put on one clock (its `clock_offset_ns`; 0 on the kernel's host, whose
ranks share its clock). On the thread that ran the cell a rank's wall time splits into:

- compute: inside a torch op (or, on a GPU, a compute kernel);
- communication: a collective in flight and no compute beside it; of it, *waiting* is the time
  before the last rank of the collective arrived;
- idle: neither (Python between ops, sleeps, reading data).

Each rank sums its own ops before sending (`summarise`): its compute intervals, its collectives
and each op name's totals, so that the kernel's work grows with the collectives, not the ops.

A collective's instances are matched across ranks by name and order (every rank of a group
issues its collectives in one order): one instance ends at about the same moment on every
rank, so a rank that entered early waited from its own start until the latest start. The rank
that arrived last is the one the others waited for; the straggler is the rank they waited for most.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import operator
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

from fsdp2nb.profile_records import (
    COLLECTIVE,
    GPU_COLLECTIVE,
    GPU_KERNEL,
    GPU_LANE_BASE,
    KIND_NAMES,
    OP,
    OpRecord,
    pack,
    pack_ints,
    unpack,
    unpack_flat,
    unpack_ints,
)
from fsdp2nb.wire.events import RankProfile

Interval = tuple[int, int]
"""[start, end) in nanoseconds on the common clock."""
NUM_TOP_OPS = 10


@dataclass(frozen=True)
class RankRow:
    """One rank's wall time and its parts, in seconds: compute + communication + idle = wall."""

    rank: int
    device: str
    wall_s: float
    compute_s: float
    communication_s: float
    """Collectives in flight with no compute beside them."""
    waiting_s: float
    """The part of communication spent before the collective's last rank arrived."""
    idle_s: float
    overlapped_s: float
    """Collectives in flight while compute ran too (counted in compute): the overlap GPU ranks aim for."""

    @property
    def overlapped_share(self) -> float | None:
        """Of all collective time, the share hidden behind compute; None without collectives."""
        total = self.communication_s + self.overlapped_s
        return self.overlapped_s / total if total > 0 else None


@dataclass(frozen=True)
class TopOp:
    """An op's time summed over every rank: self time leaves out the ops it called."""

    name: str
    calls: int
    self_s: float
    total_s: float


@dataclass(frozen=True)
class Lane:
    """What a rank's timeline draws, on the common clock."""

    rank: int
    window: Interval
    compute: tuple[Interval, ...]
    communication: tuple[Interval, ...]
    waiting: tuple[Interval, ...]
    collectives: tuple[tuple[str, Interval], ...]


@dataclass(frozen=True)
class ProfileAnalysis:
    """The analysis of one profiled cell (or `fsdp2nb.profile()` block) over its ranks."""

    cell_id: int | None
    rows: tuple[RankRow, ...]
    straggler: int | None
    """The rank the others waited for most, None when no rank waited."""
    waited_for_s: float
    """How long the other ranks waited for the straggler, summed over them."""
    top_ops: tuple[TopOp, ...]
    lanes: tuple[Lane, ...]
    clock_error_s: float
    """How far apart the ranks' clocks may be after their offsets (0 on one host)."""


def analyse(profiles: list[RankProfile]) -> ProfileAnalysis:
    """The rows, straggler, top ops and timelines of the ranks' profiles of one cell."""
    with collector_paused():
        return _analyse(profiles)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Tens of thousands of short-lived tuples would wake the cyclic garbage collector again and
    again, each time walking every object of the process: most of the analysis's time (the
    kernel's here, a rank's when it reads its events)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _analyse(profiles: list[RankProfile]) -> ProfileAnalysis:
    profiles = sorted(profiles, key=lambda profile: profile.rank)
    summaries = {profile.rank: summary_on_common_clock(profile) for profile in profiles}
    common_start = max((window_on_common_clock(profile)[0] for profile in profiles), default=0)
    waits, waited_for = _waiting({rank: summary.collectives for rank, summary in summaries.items()}, common_start)
    lanes = tuple(_lane(profile, summaries[profile.rank], waits.get(profile.rank, [])) for profile in profiles)
    rows = tuple(_row(profile, lane) for profile, lane in zip(profiles, lanes, strict=True))
    straggler = max(waited_for, key=waited_for.__getitem__) if waited_for else None
    return ProfileAnalysis(
        cell_id=profiles[0].cell_id if profiles else None, rows=rows, straggler=straggler,
        waited_for_s=waited_for[straggler] / 1e9 if straggler is not None else 0.0,
        top_ops=_top_ops(summary.op_totals for summary in summaries.values()), lanes=lanes,
        clock_error_s=max((profile.clock_error_ns for profile in profiles), default=0) / 1e9)


def on_common_clock(profile: RankProfile) -> list[OpRecord]:
    """A rank's ops with their starts moved onto the common clock."""
    return _shifted(unpack(profile.names, profile.ops), profile.clock_offset_ns)


def _shifted(records: list[OpRecord], offset_ns: int) -> list[OpRecord]:
    if not offset_ns:
        return records
    return [OpRecord(record.name, record.lane, record.kind, record.start_ns + offset_ns, record.duration_ns)
            for record in records]


def window_on_common_clock(profile: RankProfile) -> Interval:
    return profile.start_ns + profile.clock_offset_ns, profile.end_ns + profile.clock_offset_ns


# --- a rank's summary ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSummary:
    """What the analysis reads of a rank: far fewer entries than its ops."""

    compute: list[Interval]
    """Merged: ops on the thread that ran the cell, and GPU compute kernels."""
    collectives: list[OpRecord]
    op_totals: dict[str, tuple[int, int, int]]
    """name -> (calls, self ns, total ns)."""


def summarise(profile: RankProfile, flat_records: list[int]) -> RankProfile:
    """The profile with the summary of its records (given flat, as `pack` takes them) filled in."""
    names, lanes, kinds, starts, durations = (flat_records[field::5] for field in range(5))
    main_lane = profile.main_lane
    computing = [i for i, (kind, lane) in enumerate(zip(kinds, lanes, strict=True))
                 if (kind == OP and lane == main_lane) or kind == GPU_KERNEL]
    compute = _merge((starts[i], starts[i] + durations[i]) for i in computing)
    collectives = [value for i, kind in enumerate(kinds) if kind in (COLLECTIVE, GPU_COLLECTIVE)
                   for value in (names[i], lanes[i], kind, starts[i], durations[i])]
    calls = Counter(names)
    self_ns = dict.fromkeys(calls, 0)
    total_ns = dict.fromkeys(calls, 0)
    for name, own, duration in zip(names, _self_times(lanes, starts, durations), durations, strict=True):
        self_ns[name] += own
        total_ns[name] += duration
    return replace(profile, summarised=True, compute=pack_ints([edge for interval in compute for edge in interval]),
                   collectives=pack(collectives),
                   op_totals=pack_ints([v for name in calls for v in (name, calls[name], self_ns[name], total_ns[name])]))


def summary_on_common_clock(profile: RankProfile) -> RankSummary:
    """The rank's summary (summed here from its ops if the rank sent none), on the common clock."""
    if not profile.summarised:
        profile = summarise(profile, unpack_flat(profile.ops))
    offset = profile.clock_offset_ns
    return RankSummary(
        compute=[(start + offset, end + offset) for start, end in unpack_ints(profile.compute, 2)],
        collectives=_shifted(unpack(profile.names, profile.collectives), offset),
        op_totals={profile.names[name]: (calls, own, total)
                   for name, calls, own, total in unpack_ints(profile.op_totals, 4)})


# --- waiting ------------------------------------------------------------------------------------


def _collective_instances(collectives: list[OpRecord]) -> dict[tuple[str, int], OpRecord]:
    """A rank's collectives keyed by (name, how many of that name came before)."""
    seen: dict[str, int] = defaultdict(int)
    instances = {}
    for record in sorted(collectives, key=lambda r: r.start_ns):
        instances[(record.name, seen[record.name])] = record
        seen[record.name] += 1
    return instances


def _waiting(collectives: dict[int, list[OpRecord]], common_start: int) -> tuple[dict[int, list[Interval]], dict[int, int]]:
    """Each rank's waiting intervals, and how long (ns) the others waited for each rank.

    Waiting counts from `common_start`, when every rank was recording: a rank that received the
    cell later than the others is no straggler of the cell's own work."""
    instances = {rank: _collective_instances(records) for rank, records in collectives.items()}
    waits: dict[int, list[Interval]] = defaultdict(list)
    waited_for: dict[int, int] = defaultdict(int)
    keys = set().union(*(set(found) for found in instances.values())) if instances else set()
    for key in keys:
        taking_part = {rank: found[key] for rank, found in instances.items() if key in found}
        if len(taking_part) < 2:
            continue
        last = max(taking_part, key=lambda rank: taking_part[rank].start_ns)
        latest_start = taking_part[last].start_ns
        for rank, record in taking_part.items():
            start, end = max(record.start_ns, common_start), min(latest_start, record.end_ns)
            if end > start:
                waits[rank].append((start, end))
                waited_for[last] += end - start
    return waits, {rank: total for rank, total in waited_for.items() if total > 0}


# --- one rank -----------------------------------------------------------------------------------


def _lane(profile: RankProfile, summary: RankSummary, waits: list[Interval]) -> Lane:
    window = window_on_common_clock(profile)
    compute = _clipped(summary.compute, window)
    in_flight = _clipped(_merge((r.start_ns, r.end_ns) for r in summary.collectives), window)
    collectives = tuple((r.name, _clip((r.start_ns, r.end_ns), window)) for r in summary.collectives)
    return Lane(rank=profile.rank, window=window, compute=tuple(compute), communication=tuple(in_flight),
                waiting=tuple(_subtract(_merge(_clip(w, window) for w in waits), compute)), collectives=collectives)


def _row(profile: RankProfile, lane: Lane) -> RankRow:
    wall = lane.window[1] - lane.window[0]
    compute = _length(lane.compute)
    exposed = _length(_subtract(list(lane.communication), list(lane.compute)))
    overlapped = _length(_intersect(list(lane.communication), list(lane.compute)))
    return RankRow(rank=profile.rank, device=profile.device, wall_s=wall / 1e9, compute_s=compute / 1e9,
                   communication_s=exposed / 1e9, waiting_s=_length(lane.waiting) / 1e9,
                   idle_s=(wall - compute - exposed) / 1e9, overlapped_s=overlapped / 1e9)


def _top_ops(per_rank: Iterable[dict[str, tuple[int, int, int]]]) -> tuple[TopOp, ...]:
    calls: dict[str, int] = defaultdict(int)
    self_ns: dict[str, int] = defaultdict(int)
    total_ns: dict[str, int] = defaultdict(int)
    for totals in per_rank:
        for name, (name_calls, own, total) in totals.items():
            calls[name] += name_calls
            self_ns[name] += own
            total_ns[name] += total
    ranked = sorted(self_ns, key=self_ns.__getitem__, reverse=True)[:NUM_TOP_OPS]
    return tuple(TopOp(name, calls[name], self_ns[name] / 1e9, total_ns[name] / 1e9) for name in ranked)


def _self_times(lanes: list[int], starts: list[int], durations: list[int]) -> list[int]:
    """Each op's time less that of the ops nested in it on its own lane."""
    own = list(durations)
    open_ops: dict[int, list[tuple[int, int]]] = defaultdict(list)
    """lane -> (end, index) of the ops enclosing the current one, innermost last."""
    for i in _outer_first(starts, durations):
        start, enclosing = starts[i], open_ops[lanes[i]]
        while enclosing and enclosing[-1][0] <= start:
            enclosing.pop()
        if enclosing:
            own[enclosing[-1][1]] -= durations[i]
        enclosing.append((start + durations[i], i))
    return [time if time > 0 else 0 for time in own]


def _outer_first(starts: list[int], durations: list[int]) -> Sequence[int]:
    """The ops' indices by start, the longer first at one start (an op before those nested in it).
    The profiler gives them in that order already: checked, then kept, without sorting."""
    keys = list(zip(starts, map(operator.neg, durations), strict=True))
    if all(map(operator.le, keys, itertools.islice(keys, 1, None))):
        return range(len(keys))
    return sorted(range(len(keys)), key=keys.__getitem__)


# --- intervals ----------------------------------------------------------------------------------


def _clip(interval: Interval, window: Interval) -> Interval:
    return max(interval[0], window[0]), min(interval[1], window[1])


def _clipped(merged: list[Interval], window: Interval) -> list[Interval]:
    """Disjoint intervals cut to `window` (merged first: far fewer than the ops)."""
    return [clipped for clipped in (_clip(interval, window) for interval in merged) if clipped[1] > clipped[0]]


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (empty ones dropped)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if not merged or start > merged[-1][1]:
            merged.append((start, end))
        elif end > merged[-1][1]:  # most ops end inside the one they are nested in
            merged[-1] = (merged[-1][0], end)
    return merged


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    result, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            result.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return result


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of disjoint sorted `a` outside disjoint sorted `b`."""
    result: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                result.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            result.append((cursor, end))
    return result


def _length(intervals: Iterable[Interval]) -> int:
    return sum(end - start for start, end in intervals)


# --- the merged trace ---------------------------------------------------------------------------


def merged_trace(profiles: list[RankProfile]) -> dict:
    """One Chrome/Perfetto trace of every rank: a process per rank, a thread per lane, on the
    common clock (microseconds from the earliest rank's start)."""
    profiles = sorted(profiles, key=lambda profile: profile.rank)
    origin = min((window_on_common_clock(profile)[0] for profile in profiles), default=0)
    events: list[dict] = []
    for profile in profiles:
        events.append(_metadata("process_name", profile.rank, 0, f"rank {profile.rank} ({profile.device})"))
        events.append(_metadata("process_sort_index", profile.rank, 0, profile.rank, key="sort_index"))
        lanes = set()
        for record in on_common_clock(profile):
            lanes.add(record.lane)
            events.append({"ph": "X", "name": record.name, "cat": KIND_NAMES[record.kind], "pid": profile.rank,
                           "tid": record.lane, "ts": (record.start_ns - origin) / 1e3, "dur": record.duration_ns / 1e3})
        for lane in sorted(lanes):
            events.append(_metadata("thread_name", profile.rank, lane, _lane_name(profile, lane)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "ranks' Unix clocks with their offsets; error bound (s)",
                          "clock_error_s": max((p.clock_error_ns for p in profiles), default=0) / 1e9}}


def _lane_name(profile: RankProfile, lane: int) -> str:
    if lane == profile.main_lane:
        return "cell (main thread)"
    return f"stream {lane - GPU_LANE_BASE}" if lane >= GPU_LANE_BASE else f"thread {lane}"


def _metadata(name: str, pid: int, tid: int, value: object, key: str = "name") -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}
