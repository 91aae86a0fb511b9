"""What the ranks tell the kernel: a rank is ready, its output, a request's end, its resource
readings, its answers to the control thread's requests, its profiles; and a host agent's word that
a rank exited.

Every message here goes rank (or host agent) -> kernel, on the events connection. They are part of
the wire's schema (wire/protocol.py); the records they embed are in wire/records.py. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fsdp2nb.wire.records import CheckpointView, ErrorInfo, MetricPoint, ProgressUpdate

StreamName = Literal["stdout", "stderr"]
CellStatus = Literal["ok", "error"]
RichKind = Literal["display", "result", "clear"]


@dataclass(frozen=True)
class RankReady:
    """A rank joined the process group and can take cells."""

    rank: int
    pid: int
    start_time: float
    """When the rank's process started, in seconds after boot (host/process_identity.py)."""
    device: str
    hostname: str
    log_path: str
    address: str = ""
    """The rank's host on the cluster network (pools across hosts); empty on one host."""
    held_reply: int | None = None
    """A kept pool's rank that reconnects: the request whose reply (with its results) it sends
    next, because no kernel held the pool when that request ended."""

    def where(self) -> str:
        """The device, and the host where the pool spans hosts: "cuda:0 on gpu7 (10.0.0.7)"."""
        return f"{self.device} on {self.hostname} ({self.address})" if self.address else self.device


@dataclass(frozen=True)
class StreamOutput:
    """Text a rank wrote to its stdout or stderr (file-descriptor level), in order per stream."""

    rank: int
    cell_id: int | None
    stream: StreamName
    text: str


@dataclass(frozen=True)
class RichOutput:
    """A `display()` call, the cell's last expression (`result`), or `clear_output` (`clear`)."""

    rank: int
    cell_id: int | None
    kind: RichKind
    data: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CellFinished:
    """The rank finished a request; all of its output for that request has been sent before."""

    rank: int
    cell_id: int
    status: CellStatus
    error: ErrorInfo | None = None
    value: bytes | None = None


@dataclass(frozen=True)
class RankSnapshot:
    """A periodic reading of one rank's resources, sent by its sampler thread (about 2 Hz)."""

    rank: int
    time: float
    busy: bool
    rss_bytes: int
    cpu_percent: float
    device_allocated_bytes: int = 0
    device_reserved_bytes: int = 0
    device_peak_bytes: int = 0
    device_total_bytes: int = 0
    checkpoint: CheckpointView | None = None
    """Rank 0 only, once a checkpointer tracks a model."""
    rss_peak_bytes: int = 0
    """Highest RSS this rank's sampler saw since the start or the last `ResetPeak`."""
    param_bytes: int = 0
    """Bytes of the tracked model's parameters held by this rank (its local shards)."""
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    """Bytes of the tracked optimizer's state tensors held by this rank."""
    metrics: tuple[MetricPoint, ...] = ()
    """What `fsdp2nb.log` recorded since the previous snapshot."""
    trainer_checkpoints: CheckpointView | None = None
    """Rank 0 only, once a Trainer with `fsdp2nb.TrainerCallback` started: its `checkpoint-N`
    directories and how far it served the dashboard's save requests."""


@dataclass(frozen=True)
class RankExited:
    """Sent by the host agent when a rank process ended, with the tail of its stderr."""

    rank: int
    pid: int
    exit_code: int | None
    signal_name: str | None
    stderr_tail: tuple[str, ...]
    oom_killer: bool | None = None
    """For a SIGKILL: True when the kernel's OOM killer sent it (the memory cgroup counted an OOM
    kill meanwhile, or the kernel log names the pid), False when those say it did not, None
    where neither can be read."""


@dataclass(frozen=True)
class RankActivity:
    """Where a rank's main thread was when the kernel asked (`ReportActivity`), from a stack sample."""

    rank: int
    cell_id: int | None
    """The request the rank was running, None between requests."""
    where: str
    """The cell line it was on, e.g. "In[3] line 4: dist.all_reduce(t)"; empty outside any cell."""
    collective: str | None = None
    """The torch.distributed call it waits in (e.g. "all_reduce"), if any."""
    num_collectives: int | None = None
    """How many collectives the rank has entered so far (`worker/collective_count.py`): a count
    that moved between two samples is a rank at work. None where they are not counted (NCCL)."""
    sampled_at: float = 0.0
    """The rank's `time.monotonic()` at the sample: how far apart two samples of one rank were."""


@dataclass(frozen=True)
class TaskProgress:
    """How far a rank is with a long piece of work, at most a few times a second."""

    rank: int
    cell_id: int | None
    """The request that started the task (an async save may end after it)."""
    update: ProgressUpdate


@dataclass(frozen=True)
class RendezvousOpened:
    """Rank 0 of a multi-host pool opened its store on its host's cluster address; the kernel
    passes it on to the other ranks (`JoinRendezvous`)."""

    host: str
    port: int


@dataclass(frozen=True)
class InputRequested:
    """A rank's main thread called input(), getpass or a debugger prompt and waits for a line."""

    rank: int
    cell_id: int
    prompt_id: int
    """Counts the rank's prompts, so an answer is matched to the prompt it was typed for."""
    prompt: str
    password: bool = False


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a rank, as `%fsdp2 stacks` shows it."""

    name: str
    main: bool
    """The thread that runs cells."""
    frames: tuple[str, ...]
    """Outermost first, one line each: "In[3] line 4: dist.all_reduce(t)" for a cell's code,
    "file.py:12 in function" for the rest."""


@dataclass(frozen=True)
class RankStacks:
    """A rank's answer to `ReportStacks`: every thread's stack, taken without stopping any."""

    rank: int
    request_id: int
    cell_id: int | None
    """The request the rank was running, None between requests."""
    threads: tuple[ThreadStack, ...]


@dataclass(frozen=True)
class RankClock:
    """A rank's answer to `ReportClock`: its Unix clock when its control thread answered."""

    rank: int
    request_id: int
    unix_ns: int


@dataclass(frozen=True)
class RankProfile:
    """What torch.profiler recorded on a rank over a profiled cell or `fsdp2nb.profile()` block."""

    rank: int
    cell_id: int | None
    device: str
    start_ns: int
    """The window's start on the rank's clock (Unix nanoseconds, as the profiler stamps events)."""
    end_ns: int
    names: tuple[str, ...]
    """The ops' names; `ops` refers to them by index."""
    ops: bytes
    """Packed int64 records (fsdp2nb/profile_records.py): name, lane, kind, start, duration."""
    main_lane: int
    """The lane of the thread that ran the cell."""
    clock_offset_ns: int = 0
    """Added to the rank's times to put them on the kernel's clock; 0 on the kernel's host."""
    clock_error_ns: int = 0
    """How far that offset may be off (half the round trip it was measured in)."""
    kineto_trace: str = ""
    """Where a GPU rank saved the profiler's own trace (for Holistic Trace Analysis); empty on CPU ranks."""
    summarised: bool = False
    """Whether the rank summed its ops itself (the three fields below); else the kernel sums `ops`."""
    compute: bytes = b""
    """Packed int64 (start, end) pairs, merged: the main thread's ops and GPU kernels, rank clock."""
    collectives: bytes = b""
    """The collectives of `ops`, packed the same way."""
    op_totals: bytes = b""
    """Packed int64 (name index, calls, self ns, total ns), one per op name."""
    failure: str = ""
    """Why the rank could not make its profile (the error); then it holds no ops."""


EventMessage = (RankReady | StreamOutput | RichOutput | CellFinished | RankSnapshot | RankExited | TaskProgress
                | RankActivity | RendezvousOpened | InputRequested | RankStacks | RankProfile | RankClock)
