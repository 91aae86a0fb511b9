"""Test-only fault injection: kill this process at a named point inside a save.

Set FSDP2NB_CKPT_FAULT to `POINT` (every rank) or `POINT@RANK` (one rank). The variable is read at
each point, so a test can arm it between two saves of the same process.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

FAULT_ENV = "FSDP2NB_CKPT_FAULT"
FAULT_POINTS = ("write_shards", "before_metadata", "before_rename", "before_latest")


def fault_point(name: str, rank: int) -> None:
    """SIGKILL this process if FSDP2NB_CKPT_FAULT names `name` (and this rank, when one is given)."""
    assert name in FAULT_POINTS, name
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, target_rank = spec.partition("@")
    if point != name or (target_rank and int(target_rank) != rank):
        return
    logger.warning("fault injection: killing rank %d at %s", rank, name)
    os.kill(os.getpid(), signal.SIGKILL)
