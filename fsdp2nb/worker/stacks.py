"""Every thread's Python stack on a rank, for `%fsdp2 stacks`, taken by the control thread
from `sys._current_frames()`: no thread is stopped or signalled, so a running cell runs on."""

from __future__ import annotations

import linecache
import os
import sys
import threading
from types import FrameType

from fsdp2nb.wire.events import RankStacks, ThreadStack
from fsdp2nb.worker.activity import _CELL_NAME, outermost_first


def rank_stacks(rank: int, request_id: int, cell_id: int | None, main_thread_id: int) -> RankStacks:
    """The stacks of every thread of this process but the one asking, the main thread first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    asking = threading.get_ident()
    threads = [ThreadStack(name=names.get(ident, f"thread {ident}"), main=ident == main_thread_id,
                           frames=tuple(_describe(frame) for frame in outermost_first(top)))
               for ident, top in sys._current_frames().items() if ident != asking]
    threads.sort(key=lambda thread: (not thread.main, thread.name))
    return RankStacks(rank=rank, request_id=request_id, cell_id=cell_id, threads=tuple(threads))


def _describe(frame: FrameType) -> str:
    """A cell's frame as tracebacks show it ("In[3] line 4: text"), any other as file:line in function."""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    text = linecache.getline(filename, line).strip()
    match = _CELL_NAME.match(filename)
    where = f"In[{match.group(1)}] line {line}" if match else f"{_short_path(filename)}:{line} in {frame.f_code.co_name}"
    return where + (f": {text}" if text else "")


def _short_path(filename: str) -> str:
    """A path from its package on (torch/distributed/distributed_c10d.py, threading.py), not from the root."""
    for root in _LIBRARY_ROOTS:
        if filename.startswith(root):
            return filename[len(root):]
    return filename


_LIBRARY_ROOTS = tuple(sorted({os.path.join(path, "") for path in (
    *sys.path[1:], os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if path and os.path.isdir(path)}, key=len, reverse=True))
"""Where packages and the standard library live (the longest first: site-packages sits inside lib)."""
