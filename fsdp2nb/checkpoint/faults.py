"""Test-only fault injection: kill this process at a named point inside a save, or raise there.

Set FSDP2NB_CKPT_FAULT to `POINT` (every rank) or `POINT@RANK` (one rank). The variable is read at
each point, so a test can arm it between two saves of the same process. Most points kill the
process; `stage_copy` raises MemoryError, as copying the shards for an async save does when
memory runs out.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

FAULT_ENV = "FSDP2NB_CKPT_FAULT"
FAULT_POINTS = ("write_shards", "before_metadata", "before_rename", "before_latest", "stage_copy")
_RAISING_POINTS = frozenset({"stage_copy"})


def fault_point(name: str, rank: int) -> None:
    """SIGKILL this process (or raise, at a raising point) if FSDP2NB_CKPT_FAULT names `name`
    (and this rank, when one is given)."""
    assert name in FAULT_POINTS, name
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, target_rank = spec.partition("@")
    if point != name or (target_rank and int(target_rank) != rank):
        return
    if name in _RAISING_POINTS:
        raise MemoryError(f"fault injection: out of memory at {name} on rank {rank}")
    logger.warning("fault injection: killing rank %d at %s", rank, name)
    os.kill(os.getpid(), signal.SIGKILL)
