"""Which Checkpointer tracks this process's training state; readable without importing torch.

`Checkpointer.track()` records itself here and `close()` clears it. The ranks' sampler and
shutdown read the slot through `current_checkpointer()`, which never loads the checkpoint code:
a rank that never made a checkpointer pays nothing for it. The status it reports
(`CheckpointStatus`) is the wire's record, which the sampler sends on as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from fsdp2nb.errors import NoTrackedCheckpointer
from fsdp2nb.wire.records import CheckpointStatus

if TYPE_CHECKING:
    from pathlib import Path


class TrackedCheckpointer(Protocol):
    """What the ranks use of the tracked `Checkpointer` (the sampler, shutdown, `%fsdp2 save`/`load`
    and the dashboard's commands); declared here so that this module needs no checkpoint code."""

    directory: Path

    @property
    def last_step(self) -> int | None: ...

    @property
    def tracked_model(self) -> Any: ...  # torch.nn.Module

    def save(self, step: int | None = None) -> None: ...

    def maybe_save(self, step: int) -> bool: ...

    def wait(self) -> None: ...

    def load(self, target: int | str = "latest") -> int: ...

    def status(self) -> CheckpointStatus: ...


_tracked: TrackedCheckpointer | None = None


def set_tracked(checkpointer: TrackedCheckpointer) -> None:
    """Make `checkpointer` the one `%fsdp2 save` and the dashboard act on."""
    global _tracked
    _tracked = checkpointer


def clear_tracked(checkpointer: TrackedCheckpointer) -> None:
    """Forget `checkpointer` if it is the tracked one; another one stays tracked."""
    global _tracked
    if _tracked is checkpointer:
        _tracked = None


def current_checkpointer() -> TrackedCheckpointer | None:
    """The Checkpointer that most recently called `track()` in this process, or None."""
    return _tracked


def tracked_checkpointer() -> TrackedCheckpointer:
    """The Checkpointer that most recently called `track()` in this process."""
    if _tracked is None:
        raise NoTrackedCheckpointer(
            "no checkpointer is tracking a model on the ranks: run "
            "`Checkpointer(directory).track(model=model, optimizer=optimizer)` in a %%fsdp2 cell first"
        )
    return _tracked
