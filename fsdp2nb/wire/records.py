"""Records that messages carry and that both sides keep: a failed cell's error, a checkpointer's
status, a task's progress, a logged metric.

They cross inside the ranks' events (wire/events.py) and serve outside the wire too: the checkpoint
package builds `CheckpointStatus`, `fsdp2nb.progress` a `ProgressUpdate` and `fsdp2nb.log` a
`MetricPoint`; the frontend renders `ErrorInfo`. Pickle names an embedded record by its module and
class, so moving one changes the wire (wire/protocol.py). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ErrorKind = Literal["raised", "interrupted", "collective", "released"]
"""raised: the user's code raised. interrupted: KeyboardInterrupt. collective: torch.distributed
raised it from inside a collective (a timeout, a peer gone, mismatched sizes): the process groups
must be re-formed. released: a collective the kernel released (`ReleaseCollectives`) failed."""


@dataclass(frozen=True)
class MemoryShortage:
    """What a rank had when an allocation failed (torch's OutOfMemoryError, the CPU allocator's
    "can't allocate memory", MemoryError): what was asked for, what was free, what it held."""

    device: str
    """Where the allocation failed: "cpu" (host memory) or "cuda:N"."""
    requested_bytes: int | None
    """The size asked for, as the allocator's message gives it; None where it gives none."""
    free_bytes: int | None
    """Free on the device, or available on the host (its memory cgroup's limit counted)."""
    capacity_bytes: int | None
    """The device's memory, or the host's (its cgroup's limit if lower)."""
    used_bytes: int
    """What the rank held there: the CUDA allocator's allocated bytes, or the process's RSS."""
    tracked: bool
    """Whether the rank knows its model (the three figures below are its): the one a Checkpointer
    tracks, else the one `fsdp2nb.load_model` returned last, with the optimizers that stepped over it."""
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0


@dataclass(frozen=True)
class ErrorInfo:
    """An exception raised by a cell, with IPython's formatted traceback lines."""

    ename: str
    evalue: str
    traceback: tuple[str, ...]
    kind: ErrorKind = "raised"
    """What the exception was, decided on the rank from its type and where it was raised (see
    `worker.error_kinds`): never guessed from the words of its message."""
    memory: MemoryShortage | None = None
    """Set when the cell failed to allocate memory."""


@dataclass(frozen=True)
class CheckpointEntry:
    """One step directory as listed by `Checkpointer.list()` and the dashboard."""

    step: int
    """Training step."""
    path: str
    """Absolute path of the step directory."""
    wall_time: float | None
    """Seconds since the epoch when it was saved; None when the metadata is missing."""
    size_bytes: int
    """Total size of its files."""
    world_size: int | None
    """Ranks that wrote it; None when the metadata is missing."""
    valid: bool
    """True when metadata, DCP metadata and every rank file are present, each file at the size
    written (and, through `Checkpointer.list()`, none found damaged by a load)."""


@dataclass(frozen=True)
class CheckpointStatus:
    """A snapshot of a checkpointer (`Checkpointer.status()`), as the dashboard shows it."""

    directory: str
    """Absolute checkpoint directory."""
    latest_step: int | None
    """Step LATEST names (or the newest valid one); None when there is no checkpoint."""
    saving_step: int | None
    """Step of the save still being written, or None."""
    last_error: str | None
    """Text of the most recent failed save, or None."""
    entries: tuple[CheckpointEntry, ...]
    """Every step directory, oldest first."""
    blocked_s: float = 0.0
    """Seconds this rank's training has waited on saves (see Checkpointer.blocked_s)."""
    memory_step: int | None = None
    """The newest step this rank holds in host memory (`memory_every`), or None."""


@dataclass(frozen=True)
class CheckpointView:
    """What rank 0's sampler reports of its tracked checkpointer: its status, and how far it has
    served the dashboard's save requests."""

    status: CheckpointStatus
    requests_served: int = 0
    """The highest save request id (`RequestSave`) this rank has served."""
    request_step: int | None = None
    """The step of the save that served `requests_served`."""
    requests_committed: int = 0
    """The highest save request id whose save was committed."""
    request_error: str | None = None
    """Why the save that served `requests_served` failed, or None."""


@dataclass(frozen=True)
class MetricPoint:
    """Values the rank's code logged with `fsdp2nb.log(step, **values)`."""

    step: int
    time: float
    values: dict[str, float]


@dataclass(frozen=True)
class ProgressUpdate:
    """One reading of a long piece of work (`fsdp2nb.progress`): a rank's, or the pool's summed
    over its ranks (`widgets.model.TaskBoard`)."""

    task_id: int
    """Counts the rank's tasks; collective work has the same id on every rank."""
    kind: str
    """"load_model", "save", "load", "export", "train" (a Trainer's steps) or "evaluate" (batches)."""
    label: str
    done_bytes: int
    total_bytes: int
    done_items: int
    """Summed over ranks: the items every rank has done (collective work has the same items on each)."""
    total_items: int
    elapsed_s: float
    finished: bool = False
    """Summed over ranks: every rank of the pool reported its end, or one failed."""
    error: str | None = None

    @property
    def fraction(self) -> float:
        if self.finished and not self.error:
            return 1.0
        if self.total_bytes:
            return min(1.0, self.done_bytes / self.total_bytes)
        return min(1.0, self.done_items / self.total_items) if self.total_items else 0.0

    @property
    def rate(self) -> float:
        """Bytes per second since the task started."""
        return self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def seconds_left(self) -> float | None:
        if self.finished or not self.rate or not self.total_bytes:
            return None
        return max(0.0, self.total_bytes - self.done_bytes) / self.rate
