"""What saves in flight in this process use, and others must spare.

Their temporary directories: the sweep for abandoned ones (when a checkpointer is made, and before
each save) must not take a live one for a leftover. Their process groups: a rank's error in a cell
releases and re-forms the groups of the calling threads (`worker/reformable_groups.py`), while a
background save goes on in a collective of its own that every rank's save thread completes; cut,
it failed on some ranks and hung on others.
"""

from __future__ import annotations

import logging
import threading
import weakref
from pathlib import Path

from fsdp2nb.checkpoint import layout

logger = logging.getLogger(__name__)

_live: set[Path] = set()
_lock = threading.Lock()
_background_groups: weakref.WeakSet = weakref.WeakSet()
"""Groups only background saves talk over (every rank marks the same ones)."""


def started(tmp_dir: Path) -> None:
    with _lock:
        _live.add(tmp_dir)


def ended(tmp_dir: Path) -> None:
    with _lock:
        _live.discard(tmp_dir)


def live_in(directory: Path) -> frozenset[str]:
    """The names of the temporary directories in `directory` that saves of this process write."""
    with _lock:
        return frozenset(p.name for p in _live if p.parent == directory)


def sweep(directory: Path) -> None:
    """Clean abandoned temporary directories, sparing those of saves in flight in this process.

    Cleaning only tidies: rank 0 failing at it alone must not fail (and desynchronise) a save."""
    try:
        layout.recover_and_clean(directory, keep_names=live_in(directory))
    except OSError as exc:
        logger.warning("could not clean abandoned temporary directories in %s: %s", directory, exc)


def mark_background_group(group: object) -> None:
    """`group` carries only background saves' collectives: releases and re-formings leave it alone."""
    with _lock:
        _background_groups.add(group)


def is_background_group(group: object) -> bool:
    with _lock:
        return group in _background_groups
