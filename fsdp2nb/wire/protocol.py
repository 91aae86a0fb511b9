"""Every message that crosses the boundary between the notebook kernel and the ranks.

This module is the wire's schema: a change to a message type, its fields or the types that
travel raises `PROTOCOL_VERSION` (wire/versions.py compares the two ends' versions and tags the
types). Messages are frozen dataclasses, pickled and signed by `signing`. They have no
`__slots__`: pickle then takes its C path, where a slotted dataclass goes through Python-level
`__getstate__`/`__setstate__` on every hop of every cell. Nothing here imports torch,
so the kernel side stays light. User values (push/pull) travel as opaque pickled bytes inside a
message and are unpickled only after the message's signature has been verified.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

PROTOCOL_VERSION = 9
"""The version of the messages below, exchanged with the schema's fingerprint in every
connection's greeting and hello and in a kept pool's attach record; ends that differ are refused
in one line naming both (wire/versions.py). Raise it with every change of this module's types:
tests/unit/test_wire_versions.py pins each version's fingerprint. 0 is an fsdp2nb from before
versions."""

StreamName = Literal["stdout", "stderr"]
ChannelRole = Literal["requests", "control", "events"]
CellStatus = Literal["ok", "error"]
RichKind = Literal["display", "result", "clear"]
ErrorKind = Literal["raised", "interrupted", "collective", "released"]
"""raised: the user's code raised. interrupted: KeyboardInterrupt. collective: torch.distributed
raised it from inside a collective (a timeout, a peer gone, mismatched sizes): the process groups
must be re-formed. released: a collective the kernel released (`ReleaseCollectives`) failed."""


@dataclass(frozen=True)
class ChannelHello:
    """The first message on every connection: which rank opened it and what it is for.

    The kernel opens each connection with a fresh random challenge; a hello that does not carry
    it back is refused, so a signed hello recorded earlier cannot be replayed."""

    role: ChannelRole
    rank: int | None
    """None for a host agent."""
    challenge: bytes
    node: int = 0
    """Which host's agent (rank None) opened it: a pool across hosts has one agent per host."""


# --- kernel -> rank (requests and control channels) ---------------------------------------------------------


@dataclass(frozen=True)
class RunCell:
    """Execute `code` in the rank's IPython shell as one notebook cell."""

    cell_id: int
    code: str
    transformed: str | None = None
    """`code` after IPython's input transformations (magics, `!`), when the kernel did them."""
    execution_count: int | None = None
    """The notebook cell's number, so rank tracebacks say `In[N]` as the notebook does."""
    color_scheme: str | None = None
    """The notebook's IPython colour scheme (`InteractiveShell.colors`), so rank tracebacks are
    coloured as a plain cell's and stay readable on the notebook's light or dark theme."""
    profile: bool = False
    """`%%fsdp2 --profile`: run the cell under torch.profiler and send a `RankProfile` before the reply."""


@dataclass(frozen=True)
class PushValues:
    """Bind names in every rank's namespace; `payload` is a pickled dict of name -> value."""

    cell_id: int
    payload: bytes


@dataclass(frozen=True)
class PullValue:
    """Send back the value of `name`; every rank in the cell takes part (a DTensor is gathered)."""

    cell_id: int
    name: str
    reply_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Interrupt:
    """Raise KeyboardInterrupt in the rank's main thread if it is still running `cell_id`."""

    cell_id: int


@dataclass(frozen=True)
class ReleaseCollectives:
    """Make every collective this rank waits in (or enters next) fail at once: its process groups'
    connections are shut down, from the control thread, so a main thread blocked in gloo returns.
    The kernel sends it to every rank when a collective cannot complete (a rank failed or was
    interrupted while others wait); the groups are then re-formed in place (`ReformGroups`)."""

    cell_id: int
    release_id: int
    """Named by the `ReformGroups` that follows: it comes on the main channel, possibly first."""


@dataclass(frozen=True)
class RequestSave:
    """Ask the rank's tracked checkpointer to save at its next `maybe_save` (handled mid-cell).

    Every rank gets the same `request_id`, so the ranks can agree that they serve one request.
    """

    request_id: int


@dataclass(frozen=True)
class ResetPeak:
    """Start the rank's peak-memory reading afresh (the dashboard's "reset peak"; handled mid-cell)."""


@dataclass(frozen=True)
class ReportActivity:
    """Ask the rank's control thread where its main thread is (for the kernel's waiting line)."""

    cell_id: int


@dataclass(frozen=True)
class ReportStacks:
    """Ask the rank's control thread for every thread's Python stack (`%fsdp2 stacks`)."""

    request_id: int


@dataclass(frozen=True)
class ReportClock:
    """Ask the rank's control thread for its clock: a profile of ranks on several hosts puts
    them on the kernel's clock by the offsets these round trips give."""

    request_id: int


@dataclass(frozen=True)
class Shutdown:
    """Leave the rank's main loop and exit cleanly."""


@dataclass(frozen=True)
class JoinRendezvous:
    """Where rank 0's store listens (multi-host pools): the other ranks join the process group there."""

    host: str
    port: int


@dataclass(frozen=True)
class PostMortem:
    """Open the debugger at the frame where the rank's last failed cell raised (`%fsdp2 debug`)."""

    cell_id: int


@dataclass(frozen=True)
class AnswerInput:
    """The notebook's answer to a rank's `InputRequested` (control channel: the rank's main thread
    is blocked in input() meanwhile)."""

    cell_id: int
    prompt_id: int
    """The `InputRequested.prompt_id` answered; a late answer to an abandoned prompt is dropped."""
    text: str = ""
    eof: bool = False
    """The user ended input (Ctrl-D): input() raises EOFError, as it would in a terminal."""
    refusal: str = ""
    """Why nothing can answer (a frontend without stdin, a background run); raised on the rank."""


# --- fsdp2nb's own commands (kernel -> rank, requests channel) -----------------------------------


@dataclass(frozen=True)
class SaveCheckpoint:
    """`%fsdp2 save [STEP]` and the dashboard's Save: the tracked checkpointer saves and waits."""

    step: int | None = None
    """None: the last step the checkpointer saw."""
    request_id: int = 0
    """The dashboard's Save: the save request (`RequestSave` ids) the panel follows; 0 for none."""


@dataclass(frozen=True)
class LoadCheckpoint:
    """`%fsdp2 load` and the dashboard's Load: restore a step of the tracked checkpointer."""

    target: int | Literal["latest"]


@dataclass(frozen=True)
class DeleteCheckpoint:
    """The dashboard's Delete: remove one step directory (LATEST then names the newest left)."""

    step: int


@dataclass(frozen=True)
class ExportHF:
    """The dashboard's Export: write the tracked model in Hugging Face format to `path`."""

    path: str


@dataclass(frozen=True)
class SaveIfRequested:
    """At the end of a cell: make the save the dashboard asked for that no `maybe_save` reached."""


@dataclass(frozen=True)
class ReformGroups:
    """After `ReleaseCollectives`: give every process group of the rank fresh connections (the
    same group objects, so meshes, FSDP2 modules and DTensors keep working) and clear FSDP2's
    state of the iteration that failed. Every rank of the pool runs it together."""

    generation: int
    """Fresh for each re-forming: the store prefix under which the ranks meet again."""
    after_release: int | None = None
    """The `ReleaseCollectives.release_id` this follows, carried out before the groups connect;
    None after a collective that failed without a release."""


RankCommand = SaveCheckpoint | LoadCheckpoint | DeleteCheckpoint | ExportHF | SaveIfRequested | ReformGroups
"""Every command the kernel can send; `fsdp2nb.worker.commands.HANDLERS` has one handler for each."""


@dataclass(frozen=True)
class RunCommand:
    """Run one of fsdp2nb's commands on the rank, outside the user's namespace; its output, its
    errors and interrupts reach the notebook as a cell's do."""

    cell_id: int
    command: RankCommand


ControlMessage = (RunCell | PushValues | PullValue | Interrupt | RequestSave | ResetPeak | ReportActivity
                  | Shutdown | JoinRendezvous | PostMortem | AnswerInput | RunCommand | ReleaseCollectives
                  | ReportStacks | ReportClock)
FOR_CONTROL_THREAD = (Interrupt, RequestSave, ResetPeak, ReportActivity, AnswerInput, ReleaseCollectives,
                      ReportStacks, ReportClock)
"""Messages sent on a rank's control connection, which its control thread reads while a cell
runs; every other message goes to its main thread, on the requests connection."""


# --- rank -> kernel (event channel) -----------------------------------------------------------


@dataclass(frozen=True)
class RankReady:
    """A rank joined the process group and can take cells."""

    rank: int
    pid: int
    start_time: float
    """When the rank's process started, in seconds after boot (wire/process_identity.py)."""
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
class CellFinished:
    """The rank finished a request; all of its output for that request has been sent before."""

    rank: int
    cell_id: int
    status: CellStatus
    error: ErrorInfo | None = None
    value: bytes | None = None


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


EventMessage = (RankReady | StreamOutput | RichOutput | CellFinished | RankSnapshot | RankExited | TaskProgress
                | RankActivity | RendezvousOpened | InputRequested | RankStacks | RankProfile | RankClock)

@dataclass(frozen=True)
class AttachRecord:
    """Which kernel holds a kept pool and where its ranks connect (kernel -> agent and ranks).

    Written, signed with the pool's key, into the pool's directory by the kernel that starts,
    attaches or detaches; the agent and the ranks read it when woken (worker/kept.py)."""

    serial: int
    """Grows with every record: a rank reconnects only to a newer one."""
    address: str
    """The holding kernel's socket; empty while no kernel holds the pool."""
    holder_pid: int
    """The holding kernel's pid; 0 while none holds it."""
    holder_start_time: float
    """When the holding kernel's process started, in seconds after boot; 0 while none holds it."""
    since: float
    """When this kernel took the pool, or (none holding) when the last one let go (time.time())."""


WIRE_TYPES = (RunCell, PushValues, PullValue, Interrupt, RequestSave, Shutdown,
              RankReady, StreamOutput, RichOutput, CellFinished, RankSnapshot, RankExited, ResetPeak,
              TaskProgress, ReportActivity, RankActivity, JoinRendezvous, RendezvousOpened,
              PostMortem, AnswerInput, InputRequested, RunCommand, ReleaseCollectives,
              ReportStacks, RankStacks, RankProfile, ReportClock, RankClock)
"""Messages that travel as (their type's tag, field values): see signing.Signer; the tag is a
hash of the type's name and field names (wire/versions.py), not a position in this tuple."""
VERSIONED_TYPES = (ChannelHello, AttachRecord)
"""The version exchange itself: these travel in an envelope that every version reads, with the
sender's version (wire/versions.py), so that an end of another version is told so, not ignored."""


# --- launch plan (kernel -> host agent, once) --------------------------------------------------


@dataclass(frozen=True)
class RankPlan:
    """Where one rank runs: its global and local rank, its torch device string and its host."""

    rank: int
    local_rank: int
    device: str
    node: int = 0
    """The index of the host (the agent) that starts it; 0 on a one-host pool."""


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a host agent needs to start its ranks and connect them to the kernel."""

    pool_id: str
    world_size: int
    backend: str
    ranks: tuple[RankPlan, ...]
    """Every rank of the pool; each host's agent starts those of its `node`."""
    address: str
    """Where every rank and agent connection starts: the kernel's Unix socket, or
    `tcp://HOST:PORT` when ranks run on other hosts."""
    runtime_dir: str
    log_dir: str
    collective_timeout_s: float
    kernel_pid: int
    """Watched by a one-host agent; an agent on another host watches its connection instead."""
    master_port: int
    num_nodes: int = 1
    tls_fingerprint: str = ""
    """SHA-256 of the kernel's TLS certificate (hex), which ranks check; TCP addresses only."""
    kept_dir: str = ""
    """A kept pool's directory (its key, attach record and activity board); empty: the pool
    ends with its kernel."""
    keep_for_s: float | None = None
    """A kept pool that no kernel holds and that runs nothing ends after this long; None: never."""
    memory_dir: str = ""
    """The snapshot store of the pool's Checkpointers (wire/memory_store.py), kept across its
    restarts; removed by the agent when its kernel is gone (a kept pool's: when the pool expires)."""

    @property
    def multi_host(self) -> bool:
        return self.address.startswith("tcp://")

    def ranks_of_node(self, node: int) -> tuple[RankPlan, ...]:
        return tuple(rank for rank in self.ranks if rank.node == node)

    def encode(self, key: bytes) -> bytes:
        """The launch request an agent reads on its stdin: this plan and the pool key, as JSON
        (an agent may run before it can verify anything, so no pickle), on one line: the agent
        reads to its end, not to the pipe's, which a process the kernel forked may hold open."""
        return json.dumps({"plan": asdict(self), "key": key.hex()}).encode() + b"\n"

    @classmethod
    def decode(cls, request: bytes) -> tuple[LaunchPlan, bytes]:
        """The plan and pool key of a launch request made by `encode`."""
        fields = json.loads(request)
        plan = dict(fields["plan"])
        plan["ranks"] = tuple(RankPlan(**entry) for entry in plan["ranks"])
        return cls(**plan), bytes.fromhex(fields["key"])
