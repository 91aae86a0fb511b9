"""Each pool's own log file (pool.log in its log directory): what its connections went through."""

from __future__ import annotations

import logging


def open_pool_log(path: str) -> logging.Logger:
    """A logger of this pool's own that writes only to `path`.

    Made outside logging's registry, it has no parent: nothing it logs reaches the root logger's
    fallback, which in a notebook kernel writes to whatever cell runs (a flood of junk
    connections would have written a line per connection there)."""
    log = logging.Logger("fsdp2nb.pool")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return log


def close_pool_log(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        handler.close()
        log.removeHandler(handler)
    log.addHandler(logging.NullHandler())  # a late line from a closing thread goes nowhere, not to a cell
