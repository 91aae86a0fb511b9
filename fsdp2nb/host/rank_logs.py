"""The ranks' log files, named and read the same way on both sides.

Each rank tees its output into `rank-N.log` in the pool's log directory (worker/rank.py), which
is moved aside to `rank-N.log.1` when it grows past `RANK_LOG_MAX_BYTES`, so a rank that prints
for weeks keeps at most twice that on disk; its host agent appends what a dead rank left unsent
and reports the log's last lines with its exit (worker/forked_ranks.py); a kernel that
attaches a kept pool shows each log's last lines (pool/kept/holder.py).
"""

from __future__ import annotations

import contextlib
import os
import threading

RANK_LOG_MAX_BYTES = 64 << 20
"""Past this a rank's log is moved aside (replacing the one moved aside before): enough for the
tracebacks and prints of many hours and for the whole of a cell whose output the notebook cut
short (it says the rest is in the log), small beside a checkpoint."""


def rank_log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank-{rank}.log")


def rotated_path(path: str) -> str:
    """Where a log is moved when it is full (the one moved there before is replaced)."""
    return path + ".1"


class RotatingLog:
    """A log file appended to without buffering (a rank that dies loses nothing it wrote), moved
    aside once it would pass `max_bytes`; thread-safe (a rank's stdout and stderr share one)."""

    def __init__(self, path: str, max_bytes: int = RANK_LOG_MAX_BYTES) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._file = open(path, "ab", buffering=0)
        self._size = os.fstat(self._file.fileno()).st_size  # a rank restarted in the same pool appends

    def write(self, data: bytes) -> int:
        with self._lock:
            if self._size and self._size + len(data) > self._max_bytes:
                self._rotate()
            written = self._file.write(data) or 0
            self._size += written
            return written

    def _rotate(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # removed by hand: start afresh all the same
            os.replace(self.path, rotated_path(self.path))
        self._file.close()
        self._file = open(self.path, "ab", buffering=0)
        self._size = 0

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_tail(path: str, num_bytes: int) -> list[str]:
    """The lines of the last `num_bytes` of the log at `path`, reaching into the part moved aside
    when the log was rotated a moment ago (the first line may be cut); none where it cannot be read."""
    current = _last_bytes(path, num_bytes)
    if len(current) < num_bytes:
        current = _last_bytes(rotated_path(path), num_bytes - len(current)) + current
    return current.decode("utf-8", errors="replace").splitlines()


def _last_bytes(path: str, num_bytes: int) -> bytes:
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - num_bytes))
            return log.read()
    except OSError:
        return b""
