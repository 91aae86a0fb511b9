"""What the kernel asks of a rank: cells to run, values to push or pull, fsdp2nb's own commands,
and what the rank's control thread answers while a cell runs.

Every message here goes kernel -> rank. `FOR_CONTROL_THREAD` names those sent on the control
connection; the rest go on the requests connection, to the rank's main thread. They are part of
the wire's schema (wire/protocol.py). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    """`%%fsdp2 --profile`: run the cell under torch.profiler; its `RankProfile` is sent after the reply."""


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


# --- fsdp2nb's own commands (requests channel) ----------------------------------------------------


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
