"""The wire's schema: its version, the hello that opens every connection, a kept pool's attach
record, and the one table of the messages that travel.

The messages are declared by direction: what the kernel asks of a rank in wire/requests.py, what
the ranks send back in wire/events.py, the records those carry (and other code keeps) in
wire/records.py, and the plan a host agent launches in wire/launch_plan.py. A change to a type of
the schema, its fields or its module, or to the types that travel, raises `PROTOCOL_VERSION`
(wire/versions.py compares the two ends' versions and tags the types). Messages are frozen
dataclasses, pickled and signed by `signing`. They have no `__slots__`: pickle then takes its C
path, where a slotted dataclass goes through Python-level `__getstate__`/`__setstate__` on every
hop of every cell. Nothing here imports torch, so the kernel side stays light. User values
(push/pull) travel as opaque pickled bytes inside a message and are unpickled only after the
message's signature has been verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp2nb.wire import events, launch_plan, records, requests
from fsdp2nb.wire.events import (
    CellFinished,
    InputRequested,
    RankActivity,
    RankClock,
    RankExited,
    RankProfile,
    RankReady,
    RankSnapshot,
    RankStacks,
    RendezvousOpened,
    RichOutput,
    StreamOutput,
    TaskProgress,
)
from fsdp2nb.wire.requests import (
    AnswerInput,
    Interrupt,
    JoinRendezvous,
    PostMortem,
    PullValue,
    PushValues,
    ReleaseCollectives,
    ReportActivity,
    ReportClock,
    ReportStacks,
    RequestSave,
    ResetPeak,
    RunCell,
    RunCommand,
    Shutdown,
)

PROTOCOL_VERSION = 11
"""The version of the schema, exchanged with its fingerprint in every connection's greeting and
hello and in a kept pool's attach record; ends that differ are refused in one line naming both
(wire/versions.py). Raise it with every change of the schema's types:
tests/unit/test_wire_versions.py pins each version's fingerprint. 0 is an fsdp2nb from before
versions. 10: the messages and records moved into modules by direction, and pickle names an
embedded record by its module."""

ChannelRole = Literal["requests", "control", "events"]


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


@dataclass(frozen=True)
class AttachRecord:
    """Which kernel holds a kept pool and where its ranks connect (kernel -> agent and ranks).

    Written, signed with the pool's key, into the pool's directory by the kernel that starts,
    attaches or detaches; the agent and the ranks read it when woken (pool/kept/keeper.py)."""

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
SCHEMA_MODULES = (requests, events, records, launch_plan)
"""Where the schema's other types are declared: every dataclass of this module and of these is
part of the schema's fingerprint (wire/versions.py)."""
