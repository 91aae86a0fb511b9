"""What the dashboard shows, computed from snapshots alone: no widgets, no processes, no torch.

`DashboardModel` is fed `RankSnapshot`s and `PoolFacts` by whoever owns the pool, keeps bounded
histories (memory per rank, logged metrics), follows a save request until its outcome, and
answers the questions the views ask. It is tested with synthetic snapshots.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from fsdp2nb.profile_analysis import ProfileAnalysis
from fsdp2nb.sizes import mib
from fsdp2nb.wire.events import RankSnapshot, TaskProgress
from fsdp2nb.wire.records import CheckpointStatus, CheckpointView, MetricPoint, ProgressUpdate

HISTORY_S = 300.0
"""How far back the memory sparklines reach."""
MAX_HISTORY_POINTS = 600
"""Per rank: five minutes of snapshots at 2 Hz."""
MAX_METRIC_POINTS = 2_000
"""Per rank; past it every other old point is dropped, so a week-long run keeps a flat memory."""
WARN_FRACTION = 0.9


@dataclass(frozen=True)
class PoolFacts:
    """What the pool's owner knows beyond snapshots (states, pids, devices, deaths)."""

    state: str
    """"stopped", "starting", "ready" or "broken" (a rank died)."""
    world_size: int
    description: str = ""
    devices: dict[int, str] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    deaths: dict[int, str] = field(default_factory=dict)
    """Rank -> "killed by SIGKILL" or "exit code 1"."""
    busy: frozenset[int] = frozenset()
    busy_since: dict[int, float] = field(default_factory=dict)
    """Rank -> when it started what it runs (time.time()), where known: a run that began before
    the dashboard saw it (a kept pool's, attached) is timed from its start."""
    host_total_bytes: int = 0
    """Memory of the host, the limit a CPU rank's bar is drawn against."""


@dataclass(frozen=True)
class MemoryReading:
    """One rank's bar: `used` (and `reserved`, `peak`) against `total`, all in bytes."""

    kind: str  # "gpu" or "cpu"
    used: int
    reserved: int
    peak: int
    total: int
    rss: int
    tracked: tuple[int, int, int]
    """Bytes of the tracked model's parameters, gradients and optimizer state on the rank."""

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        """What `used` is made of: ("params" | "grads" | "optimizer" | "other", bytes). The tracked
        sizes are those the last cell left; "other" is the rest of `used` (never below 0, as when
        offloaded state in host memory is set against a GPU's allocation)."""
        params, grads, optimizer = self.tracked
        return (("params", params), ("grads", grads), ("optimizer", optimizer),
                ("other", max(0, self.used - params - grads - optimizer)))

    @property
    def fraction(self) -> float:
        return max(self.used, self.reserved) / self.total if self.total else 0.0

    @property
    def warning(self) -> bool:
        return self.fraction > WARN_FRACTION


@dataclass(frozen=True)
class RankRow:
    """Everything one rank's line of the dashboard shows."""

    rank: int
    state: str  # "idle", "busy", "dead", "starting", "stopped"
    state_text: str
    device: str
    pid: int | None
    memory: MemoryReading | None
    history: tuple[float, ...]
    """Used bytes over the last HISTORY_S, oldest first."""
    time_split: TimeSplit | None = None
    """Where the last profiled cell's time went on this rank; None before any profile."""


@dataclass(frozen=True)
class TimeSplit:
    """A rank's last profiled wall time in parts (seconds): compute + communication + idle = wall."""

    wall_s: float
    compute_s: float
    communication_s: float
    waiting_s: float
    """Of communication, waiting for the other ranks."""
    idle_s: float
    straggler: bool
    """The rank the others waited for most."""



class MetricsHistory:
    """Logged points per rank, bounded by halving the resolution of the oldest part; thread-safe
    (fed on whichever thread brings the model up to date, read by `%fsdp2 metrics` and the views)."""

    def __init__(self, max_points: int = MAX_METRIC_POINTS) -> None:
        self._max_points = max_points
        self._lock = threading.Lock()
        self._points: dict[int, list[MetricPoint]] = {}
        self.version = 0
        """Counts additions, so a view redraws a plot only when there is something new."""

    def add(self, rank: int, points: tuple[MetricPoint, ...]) -> None:
        if not points:
            return
        with self._lock:
            self.version += 1
            kept = self._points.setdefault(rank, [])
            kept.extend(points)
            if len(kept) > self._max_points:
                half = len(kept) // 2
                kept[:half] = kept[:half:2]  # the older half at half the resolution

    def _copy(self) -> dict[int, list[MetricPoint]]:
        """A copy of every rank's points as they are now, in rank order, for reading without the lock."""
        with self._lock:
            return {rank: list(points) for rank, points in sorted(self._points.items())}

    def points(self, rank: int = 0) -> list[MetricPoint]:
        with self._lock:
            return list(self._points.get(rank, ()))

    def names(self, rank: int = 0) -> list[str]:
        seen: dict[str, None] = {}
        for point in self.points(rank):
            seen.update(dict.fromkeys(point.values))
        return list(seen)

    def series(self, name: str, view: str) -> dict[str, list[tuple[int, float]]]:
        """(step, value) lines to plot: `view` is "rank 0", "mean" (over ranks, per step) or "all ranks"."""
        per_rank = {rank: [(p.step, p.values[name]) for p in points if name in p.values]
                    for rank, points in self._copy().items()}
        if view == "all ranks":
            return {f"rank {rank}": line for rank, line in per_rank.items() if line}
        if view == "mean":
            by_step: dict[int, list[float]] = {}
            for line in per_rank.values():
                for step, value in line:
                    by_step.setdefault(step, []).append(value)
            return {"mean": [(step, sum(v) / len(v)) for step, v in sorted(by_step.items())]}
        return {"rank 0": per_rank.get(0, [])}

    def rows(self) -> list[dict]:
        """Every point as a dict (rank, step, time, and its values), for `%fsdp2 metrics`."""
        return [dict(rank=rank, step=p.step, time=p.time, **p.values)
                for rank, points in self._copy().items() for p in points]


MAX_TASKS = 8


class TaskBoard:
    """The latest progress event of each rank for the last few tasks, read summed over the ranks
    as one `ProgressUpdate`; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[tuple[int, str, str], dict[int, TaskProgress]] = {}
        self.version = 0

    def observe(self, event: TaskProgress) -> None:
        key = (event.update.task_id, event.update.kind, event.update.label)
        with self._lock:
            self.version += 1
            self._tasks.setdefault(key, {})[event.rank] = event
            self._tasks[key] = self._tasks.pop(key)  # the most recently updated task last
            while len(self._tasks) > MAX_TASKS:
                del self._tasks[next(iter(self._tasks))]

    def latest(self, world_size: int) -> ProgressUpdate | None:
        with self._lock:
            if not self._tasks:
                return None
            return _summed(next(reversed(self._tasks.values())), world_size)

    def find(self, kind: str, label: str, world_size: int) -> ProgressUpdate | None:
        """The newest task of `kind` with `label`, or None."""
        with self._lock:
            for (_, task_kind, task_label), by_rank in reversed(self._tasks.items()):
                if (task_kind, task_label) == (kind, label):
                    return _summed(by_rank, world_size)
        return None

    def clear(self) -> None:
        with self._lock:
            self._tasks.clear()
            self.version += 1


def _summed(by_rank: dict[int, TaskProgress], world_size: int) -> ProgressUpdate:
    """One task as the pool has done it: bytes summed, items done by every rank, finished when
    every rank of the pool reported its end (or one failed: its error, naming the rank)."""
    ranks = sorted(by_rank)
    updates = [by_rank[rank].update for rank in ranks]
    complete = len(updates) >= world_size
    errors = [f"rank {rank}: {update.error}" for rank, update in zip(ranks, updates, strict=True) if update.error]
    first = updates[0]
    return ProgressUpdate(
        task_id=first.task_id, kind=first.kind, label=first.label,
        done_bytes=sum(u.done_bytes for u in updates), total_bytes=sum(u.total_bytes for u in updates),
        done_items=min(u.done_items for u in updates) if complete else 0,
        total_items=max(u.total_items for u in updates), elapsed_s=max(u.elapsed_s for u in updates),
        finished=bool(errors) or (complete and all(u.finished for u in updates)),
        error=errors[0] if errors else None)


class DashboardModel:
    """Bounded state behind every view of the dashboard; thread-safe (fed and read from threads).

    However long the session, it holds per rank the latest snapshot, `MAX_HISTORY_POINTS` memory
    readings and at most `MAX_METRIC_POINTS` logged points (older ones at half the resolution),
    and the last `MAX_TASKS` tasks' progress: a day of cells grows none of it past these."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.facts = PoolFacts(state="stopped", world_size=0)
        self.snapshots: dict[int, RankSnapshot] = {}
        self.metrics = MetricsHistory()
        self.tasks = TaskBoard()
        self._history: dict[int, deque[tuple[float, int]]] = {}
        self._busy_since: dict[int, float] = {}
        self._save: int | None = None
        """The id of the save request followed to its outcome."""
        self._save_text = ""
        self.save_text_version = 0
        """Counts the changes of `save_text`: a view shows the line again when it changed back to
        a text shown before (saved step 7, then a new request, then saved step 7 again)."""
        self.notice = ""
        """The last thing that happened to the pool itself (a rank died and the pool was replaced)."""
        self.profile: ProfileAnalysis | None = None
        """The last profile the notebook showed (`%%fsdp2 --profile`, `fsdp2nb.profile()`)."""

    # --- feeding ------------------------------------------------------------------------------

    def observe(self, snapshot: RankSnapshot | TaskProgress | ProfileAnalysis | object) -> None:
        if isinstance(snapshot, ProfileAnalysis):
            with self._lock:
                self.profile = snapshot
            return
        if not isinstance(snapshot, (RankSnapshot, TaskProgress)):
            return  # a rank's profile or stacks, for the frontend's collector
        if isinstance(snapshot, TaskProgress):
            self.tasks.observe(snapshot)
            return
        with self._lock:
            self.snapshots[snapshot.rank] = snapshot
            used = snapshot.device_allocated_bytes if snapshot.device_total_bytes else snapshot.rss_bytes
            history = self._history.setdefault(snapshot.rank, deque(maxlen=MAX_HISTORY_POINTS))
            history.append((snapshot.time, used))
            self.metrics.add(snapshot.rank, snapshot.metrics)
            for view in (snapshot.checkpoint, snapshot.trainer_checkpoints):  # whichever took the save
                if view is not None:
                    self._follow_save(view)

    def set_facts(self, facts: PoolFacts, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            for rank in facts.busy - self.facts.busy:
                self._busy_since[rank] = facts.busy_since.get(rank, now)
            if self.facts.deaths and not facts.deaths and facts.state != "broken":
                self.notice = "; ".join(f"rank {rank} died ({why})" for rank, why in sorted(self.facts.deaths.items()))
                self.notice += ": the pool was replaced and all rank state was lost"
            if facts.state == "starting" and self.facts.state != "starting":
                self.tasks.clear()  # a new pool counts its tasks afresh
                self._history.clear()  # a new pool: the old ranks' readings would mislead
                self.snapshots.clear()
            self.facts = facts

    # --- saves asked for while a cell runs ------------------------------------------------------

    @property
    def save_text(self) -> str:
        """The outcome line of the last save asked for from the dashboard."""
        return self._save_text

    @save_text.setter
    def save_text(self, text: str) -> None:
        if text != self._save_text:
            self._save_text, self.save_text_version = text, self.save_text_version + 1

    @property
    def save_pending(self) -> bool:
        """Whether a save asked for from the dashboard has not reached its outcome yet."""
        return self._save is not None

    def save_requested(self, request_id: int,
                       text: str = "save requested: it happens at the training loop's next maybe_save") -> None:
        """Follow the save of request `request_id` (a `RequestSave` id) to its outcome."""
        with self._lock:
            self._save, self.save_text = request_id, text

    def cell_ended_with_request(self) -> None:
        with self._lock:
            if self._save is None or self._served_already(self._save):
                return  # its save is in flight: the next snapshot says how it ended
            if self.checkpoint is None and self.trainer_checkpoints is not None:
                return  # only a Trainer serves it, at a step's end: its snapshot, late or not, says whether it did
            self.save_text = ("the cell ended before its next maybe_save: saving at the last step "
                              "the checkpointer saw")

    def _served_already(self, request_id: int) -> bool:
        """Whether some rank's last snapshot said the request was taken by a save."""
        return any(view is not None and view.requests_served >= request_id
                   for snapshot in self.snapshots.values()
                   for view in (snapshot.checkpoint, snapshot.trainer_checkpoints))

    def _follow_save(self, view: CheckpointView) -> None:
        """By the request's id alone: LATEST may name the saved step before the save (a notebook
        run again into the same directory) and another step after it (a later save)."""
        request_id = self._save
        if request_id is None or view.requests_served < request_id:
            return
        step = view.request_step
        if view.request_error:
            self.save_text, self._save = f"save failed: {view.request_error}", None
        elif view.requests_committed < request_id:
            self.save_text = self._saving_text(step)
        else:
            task = self.tasks.find("save", f"saving step {step}", self.facts.world_size)
            if task is not None and not task.finished:  # committed; its last progress event is on its way
                self.save_text = self._saving_text(step)
                return
            self.save_text, self._save = self._saved_text(step), None

    def _saving_text(self, step: int | None) -> str:
        """`saving step N: X of Y MiB` once the ranks report bytes written."""
        task = self.tasks.find("save", f"saving step {step}", self.facts.world_size)
        if task is None or not task.total_bytes:
            return f"saving step {step} ..."
        return f"saving step {step}: {mib(task.done_bytes, 1)} of {mib(task.total_bytes, 1)}"

    def _saved_text(self, step: int | None) -> str:
        task = self.tasks.find("save", f"saving step {step}", self.facts.world_size)
        if task is None or not task.finished:
            return f"saved step {step}"
        return f"saved step {step} in {task.elapsed_s:.1f} s"

    # --- reading ------------------------------------------------------------------------------

    @property
    def checkpoint(self) -> CheckpointStatus | None:
        """Rank 0's tracked checkpointer, once one tracks a model."""
        snapshot = self.snapshots.get(0)
        return snapshot.checkpoint.status if snapshot is not None and snapshot.checkpoint is not None else None

    @property
    def trainer_checkpoints(self) -> CheckpointStatus | None:
        """Rank 0's Trainer's `checkpoint-N` directories, once a Trainer with fsdp2nb.TrainerCallback started."""
        snapshot = self.snapshots.get(0)
        view = snapshot.trainer_checkpoints if snapshot is not None else None
        return view.status if view is not None else None

    def rows(self, now: float | None = None) -> list[RankRow]:
        now = time.time() if now is None else now
        with self._lock:
            return [self._row(rank, now) for rank in range(self.facts.world_size)]

    def _row(self, rank: int, now: float) -> RankRow:
        snapshot = self.snapshots.get(rank)
        state, text = self._state(rank, now)
        history = tuple(used for t, used in self._history.get(rank, ()) if now - t <= HISTORY_S)
        return RankRow(rank=rank, state=state, state_text=text, device=self.facts.devices.get(rank, "-"),
                       pid=self.facts.pids.get(rank), memory=self._memory(snapshot), history=history,
                       time_split=self._time_split(rank))

    def _time_split(self, rank: int) -> TimeSplit | None:
        profile = self.profile
        row = next((row for row in profile.rows if row.rank == rank), None) if profile is not None else None
        if row is None:
            return None
        assert profile is not None, "a row comes from a profile"
        return TimeSplit(wall_s=row.wall_s, compute_s=row.compute_s, communication_s=row.communication_s,
                         waiting_s=row.waiting_s, idle_s=row.idle_s, straggler=profile.straggler == rank)

    def _state(self, rank: int, now: float) -> tuple[str, str]:
        facts = self.facts
        if rank in facts.deaths:
            return "dead", f"dead: {facts.deaths[rank]}"
        if facts.state in ("starting", "stopped"):
            return facts.state, "restarting" if facts.state == "starting" else "stopped"
        if rank in facts.busy:
            return "busy", f"busy {_duration(now - self._busy_since.get(rank, now))}"
        return "idle", "idle"

    def _memory(self, snapshot: RankSnapshot | None) -> MemoryReading | None:
        if snapshot is None:
            return None
        tracked = (snapshot.param_bytes, snapshot.grad_bytes, snapshot.optimizer_bytes)
        if snapshot.device_total_bytes:
            return MemoryReading("gpu", snapshot.device_allocated_bytes, snapshot.device_reserved_bytes,
                                 snapshot.device_peak_bytes, snapshot.device_total_bytes, snapshot.rss_bytes, tracked)
        return MemoryReading("cpu", snapshot.rss_bytes, 0, max(snapshot.rss_peak_bytes, snapshot.rss_bytes),
                             self.facts.host_total_bytes, snapshot.rss_bytes, tracked)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
