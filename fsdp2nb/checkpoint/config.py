"""Validated settings for Checkpointer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp2nb.config_checks import check_bool, check_choice
from fsdp2nb.errors import InvalidValue

AsyncWriter = Literal["process", "thread"]
ASYNC_WRITERS: tuple[AsyncWriter, ...] = ("process", "thread")


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointerConfig:
    """How a Checkpointer retains and writes checkpoints."""

    keep: int | None = 3
    """How many valid checkpoints to retain, counting steps up to the one saved; None keeps all."""

    async_save: bool = True
    """Let training continue while the files are written; the next optimizer step waits only for the copy."""

    async_writer: AsyncWriter = "thread"
    """Where an async save writes: "thread" (this process) or "process" (DCP's writer process,
    off this process's GIL, at the lowest CPU priority)."""

    checksums: bool = True
    """Record each shard's CRC32 while writing it, and check every file against it before a load
    (one extra read of the checkpoint); sizes are checked either way."""

    memory_every: int | None = None
    """Every this many steps `maybe_save` also copies the state into host memory that outlives the
    ranks (restored after a process dies); None: only disk saves."""

    def __post_init__(self) -> None:
        if self.memory_every is not None and (isinstance(self.memory_every, bool) or not isinstance(self.memory_every, int)
                                              or self.memory_every < 1):
            raise InvalidValue(f"memory_every={self.memory_every!r} is not allowed; choose None (no snapshots in "
                               "memory) or an int >= 1 (every that many steps)")
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1):
            raise InvalidValue(f"keep={self.keep!r} is not allowed; choose None (keep all) or an int >= 1")
        check_bool("async_save", self.async_save)
        check_bool("checksums", self.checksums)
        check_choice("async_writer", self.async_writer, ASYNC_WRITERS)
