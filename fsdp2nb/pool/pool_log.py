"""Each pool's own log file (pool.log in its log directory): what its connections went through."""

from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler

POOL_LOG_MAX_BYTES = 4 << 20
"""Past this pool.log is moved aside to pool.log.1 (replacing the one before): a pool that meets a
flood of junk connections, a line each, for days keeps at most twice this on disk."""


def open_pool_log(path: str, max_bytes: int = POOL_LOG_MAX_BYTES) -> logging.Logger:
    """A logger of this pool's own that writes only to `path`, rotated past `max_bytes`.

    Made outside logging's registry, it has no parent: nothing it logs reaches the root logger's
    fallback, which in a notebook kernel writes to whatever cell runs (a flood of junk
    connections would have written a line per connection there)."""
    log = logging.Logger("fsdp2nb.pool")
    handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=1)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log


def close_pool_log(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        handler.close()
        log.removeHandler(handler)
    log.addHandler(logging.NullHandler())  # a late line from a closing thread goes nowhere, not to a cell
