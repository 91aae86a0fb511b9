"""The ranks' log files, named and read the same way on both sides.

Each rank tees its output into `rank-N.log` in the pool's log directory (worker/rank.py); its
host agent appends what a dead rank left unsent and reports the log's last lines with its exit
(worker/agent.py); a kernel that attaches a kept pool shows each log's last lines (pool/kept.py).
"""

from __future__ import annotations

import os


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank-{rank}.log")


def read_tail(path: str, num_bytes: int) -> list[str]:
    """The lines of the last `num_bytes` of the file at `path` (the first may be cut); none
    where it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - num_bytes))
            return log.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
