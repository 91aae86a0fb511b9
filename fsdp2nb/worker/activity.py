"""Where a rank's main thread is, from a stack sample its control thread takes.

The kernel asks while a cell waits (a collective that not every rank entered waits silently until
its timeout), so the notebook can say which cell line each rank is on and which collective it
waits in. Sampling reads `sys._current_frames()`: the main thread is not stopped or signalled.
A sample also carries how many collectives the rank has entered (`worker/collective_count.py`),
the progress that tells a loop of collectives from a hang in one.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import time
from types import FrameType

from fsdp2nb.wire.events import RankActivity
from fsdp2nb.worker.collective_count import num_entered

_CELL_NAME = re.compile(r"^<ipython-input-(\d+)-")
"""How IPython names a cell's code (the rank's compiler keeps IPython's naming)."""
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_WRAPPER_NAMES = {"wrapper", "inner", "_fn"}
_QUERY_PREFIXES = ("get_", "is_")
"""Public torch.distributed functions that answer at once (get_rank, is_initialized): not waits."""
_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def sample_activity(rank: int, cell_id: int | None, main_thread_id: int, *,
                    counts_collectives: bool) -> RankActivity:
    """Where the main thread is now; `counts_collectives`: whether the rank's groups count what
    they enter (else the sample carries no count, and the kernel compares positions only)."""
    where, collective = main_thread_activity(main_thread_id) if cell_id is not None else ("", None)
    return RankActivity(rank=rank, cell_id=cell_id, where=where, collective=collective,
                        num_collectives=num_entered() if counts_collectives else None, sampled_at=time.monotonic())


def main_thread_activity(main_thread_id: int) -> tuple[str, str | None]:
    """(the cell line the main thread is on, the torch.distributed call it is in) for a rank."""
    frame = sys._current_frames().get(main_thread_id)
    if frame is None:
        return "", None
    frames = outermost_first(frame)
    return _cell_line(frames), _collective(frames)


def outermost_first(frame: FrameType | None) -> list[FrameType]:
    """A thread's frames from `frame` out to its first, the first one first (as tracebacks read)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames[::-1]


def _cell_line(frames: list[FrameType]) -> str:
    """The innermost frame of a cell's code (a function a cell defined counts too)."""
    for frame in reversed(frames):
        filename = frame.f_code.co_filename
        match = _CELL_NAME.match(filename)
        if match is None:
            continue
        text = linecache.getline(filename, frame.f_lineno).strip()
        return f"In[{match.group(1)}] line {frame.f_lineno}" + (f": {text}" if text else "")
    return ""


def _collective(frames: list[FrameType]) -> str | None:
    """The outermost public torch.distributed function on the stack (its wrappers skipped), or
    else a wait on a collective's work inside torch.distributed (FSDP2's all-gathers and
    reduce-scatters are started asynchronously and waited for there)."""
    for frame in frames:
        name = frame.f_code.co_name
        if frame.f_code.co_filename.endswith(_C10D_FILE) and name not in _WRAPPER_NAMES \
                and not name.startswith(("_", *_QUERY_PREFIXES)):
            return name
    innermost = frames[-1] if frames else None
    if innermost is not None and _TORCH_DISTRIBUTED in innermost.f_code.co_filename:
        line = linecache.getline(innermost.f_code.co_filename, innermost.f_lineno)
        if ".wait(" in line:
            return f"a wait in {innermost.f_code.co_name}"
    return None
