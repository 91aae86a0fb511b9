"""What the kernel knows about one request while it runs: the state the wait
(`frontend/request_wait.py`), the prompt relay (`rank_prompts.py`) and the release from
collectives (`released_collectives.py`) share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp2nb.frontend.waiting_ranks import CollectiveCounts
from fsdp2nb.wire.events import CellFinished, InputRequested, RankActivity, RichOutput
from fsdp2nb.wire.records import ErrorInfo

if TYPE_CHECKING:
    from fsdp2nb.frontend.output import WaitingLine
    from fsdp2nb.frontend.progress_bar import CellTaskBar


@dataclass
class CellProgress:
    """What the kernel knows about one request while it runs."""

    ranks: tuple[int, ...]
    finished: dict[int, CellFinished] = field(default_factory=dict)
    errors: list[tuple[int, ErrorInfo]] = field(default_factory=list)
    results: list[tuple[int, RichOutput]] = field(default_factory=list)
    first_error_at: float | None = None
    interrupted_at: float | None = None
    interrupted_after_error: bool = False
    """The ranks were interrupted because another rank had failed, not by the stop button."""
    second_press: bool = False
    """The stop button was pressed again after its interrupt: that press releases the collectives
    (or finds them released after a rank's error); only a press after it restarts the pool."""
    task_bar: CellTaskBar | None = None
    """The cell's progress bar (frontend.progress_bar), made when the ranks first report progress."""
    started_at: float = field(default_factory=time.monotonic)
    holder_checked_at: float = 0.0
    """When the kept pool's attach record was last read (see RequestWait._check_still_held)."""
    last_output_at: float = field(default_factory=time.monotonic)
    activity_asked_at: float = 0.0
    asked_after_error_at: float = 0.0
    """When the running ranks were last asked where they are after another failed (apart from
    the quiet ranks' asks, which also look for ranks that ended unreported)."""
    activity: dict[int, RankActivity] = field(default_factory=dict)
    """Where each rank was when last asked (RankActivity), while the cell waited."""
    collective_since: dict[int, float] = field(default_factory=dict)
    """When each rank was first seen in the collective it is in now (for the time left of its timeout)."""
    collective_counts: CollectiveCounts = field(default_factory=CollectiveCounts)
    """How many collectives each rank had entered, as first seen: a count that does not move
    while a rank sits in a collective is what makes it wait (frontend/waiting_ranks.py)."""
    waiting_line: WaitingLine | None = None
    stopped: dict[int, int] = field(default_factory=dict)
    """Ranks that did not answer because a signal stopped them (rank -> pid), as last seen."""
    diverged_at: float | None = None
    """When the ranks were first seen at diverging points (see released_collectives.ranks_diverge),
    where positions decide: ranks that do not count their collectives."""
    activity_at: dict[int, float] = field(default_factory=dict)
    """When each rank last said where it is."""
    last_line: dict[int, str] = field(default_factory=dict)
    """The last cell line each rank was seen on (a rank that has left the cell reports none)."""
    released_at: float | None = None
    """When the ranks' collectives were released (see CollectiveRelease.release)."""
    release_cause: str = ""
    """Why they were, as the cell says it: what the released ranks waited for."""
    released_from: dict[int, str] = field(default_factory=dict)
    """rank -> the collective it waited in when released (where it was known)."""
    prompts: dict[int, InputRequested] = field(default_factory=dict)
    """Ranks waiting for a line of input, answered one at a time in rank order."""

    @property
    def running(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]

    @property
    def stopped_by_user(self) -> bool:
        """Whether the stop button interrupted the ranks (not the wait, after another rank failed)."""
        return self.interrupted_at is not None and not self.interrupted_after_error
