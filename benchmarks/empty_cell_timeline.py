"""Where an empty `%%fsdp2` cell's time goes: the kernel's and the ranks' steps on one clock.

Kernel and ranks share the host's monotonic clock, so the moment each rank reads the request and
sends its reply can be set beside the kernel's own steps. Cells in the kernel and on the ranks
wrap a few methods to note times (the wrapping adds a few microseconds to each step it times),
then `--cells` empty cells run and the medians of each step are printed:
  before the send       IPython's run_cell up to the send (a plain cell is sent at `pre_run_cell`)
  the send              packing, signing and writing the request to every rank, in turn
  first / last read     from the send's start until the first and the last rank read the request
  on a rank             from reading the request to sending the reply
  kernel until it waits from the send's end until the wait begins (IPython's history, compiling
                        and calling the magic, meanwhile the ranks run)
  reply to kernel       from the last rank's reply until the kernel has read it
  after the replies     from then until IPython's run_cell returns
  the cell              IPython's run_cell, whole
Run: .venv/bin/python -m benchmarks.empty_cell_timeline [--ranks 2] [--cells 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

# On every rank: when its main thread reads a request, and when it sends the reply.
RANK_CLOCK = """%%fsdp2
import threading, time
from fsdp2nb.wire import signing as _signing
from fsdp2nb.worker import rank as _rank
_noted, _main_thread = [], threading.get_ident()
def _noting(function, label, main_thread_only):
    def noted(*args, **kwargs):
        if not main_thread_only or threading.get_ident() == _main_thread:
            _noted.append((label, time.monotonic()))
        return function(*args, **kwargs)
    return noted
_signing.Signer.unpack = _noting(_signing.Signer.unpack, "read", True)
_rank.Rank._send_reply = _noting(_rank.Rank._send_reply, "reply", False)
"""

# In the kernel: the magic's entry and exit, the send's start and end, and each reply's arrival.
KERNEL_CLOCK = """
import time
from fsdp2nb.frontend import request_wait as _request_wait
from fsdp2nb.pool import rank_events as _rank_events
_noted = []
def _noting(function, label):
    def noted(*args, **kwargs):
        _noted.append((label + " start", time.monotonic()))
        try:
            return function(*args, **kwargs)
        finally:
            _noted.append((label + " end", time.monotonic()))
    return noted
get_ipython().run_cell = _noting(get_ipython().run_cell, "cell")
_request_wait.RequestWait.send = _noting(_request_wait.RequestWait.send, "send")
_request_wait.RequestWait.wait_for_replies = _noting(_request_wait.RequestWait.wait_for_replies, "wait")
_sort = _rank_events.RankEvents.sort
def _sort_noted(self, event):
    if type(event).__name__ == "CellFinished":
        _noted.append(("reply", time.monotonic()))
    return _sort(self, event)
_rank_events.RankEvents.sort = _sort_noted
"""


def cells_from(kernel_noted: list, rank_noted: dict[str, list]) -> list[dict]:
    """One dict per cell: the kernel's times and every rank's read and reply within them."""
    cells, current = [], None
    for label, when in kernel_noted:
        if label == "cell start":
            current = {"replies": []}
        if current is None:
            continue
        if label == "reply":
            current["replies"].append(when)
        else:
            current[label] = when
        if label == "cell end":
            cells.append(current)
            current = None
    for noted in rank_noted.values():
        for cell in cells:
            if "send start" not in cell:  # a cell of the kernel's own (reading the times)
                continue
            within = [(label, when) for label, when in noted if cell["send start"] <= when <= cell["cell end"]]
            reads = [when for label, when in within if label == "read"]
            replies = [when for label, when in within if label == "reply"]
            if reads and replies:
                cell.setdefault("ranks", []).append((reads[0], replies[0]))
    num_ranks = len(rank_noted)
    return [cell for cell in cells if len(cell.get("ranks", [])) == num_ranks and len(cell["replies"]) >= num_ranks
            and "wait start" in cell]


STEPS = {
    "before the send": lambda c: c["send start"] - c["cell start"],
    "the send": lambda c: c["send end"] - c["send start"],
    "first read": lambda c: min(read for read, _ in c["ranks"]) - c["send start"],
    "last read": lambda c: max(read for read, _ in c["ranks"]) - c["send start"],
    "on a rank": lambda c: statistics.mean(reply - read for read, reply in c["ranks"]),
    "kernel until it waits": lambda c: c["wait start"] - c["send end"],
    "reply to kernel": lambda c: max(c["replies"]) - max(reply for _, reply in c["ranks"]),
    "after the replies": lambda c: c["cell end"] - max(c["replies"]),
    "the cell": lambda c: c["cell end"] - c["cell start"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cells", type=int, default=300)
    args = parser.parse_args()
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        kernel.execute("%load_ext fsdp2nb")
        assert kernel.execute(f"%fsdp2 start --cpu {args.ranks} --no-dashboard").status == "ok"
        for _ in range(30):
            kernel.execute("%%fsdp2\npass")
        assert kernel.execute(RANK_CLOCK).status == "ok"
        assert kernel.execute(KERNEL_CLOCK).status == "ok"
        for _ in range(args.cells):
            kernel.execute("%%fsdp2\npass")
        kernel_noted = json.loads(kernel.execute("import json\nprint(json.dumps(_noted))").stdout)
        read = kernel.execute("%%fsdp2\nimport json\nprint(json.dumps(_noted))")
        rank_noted = dict(line.split(" ", 1) for line in read.stdout.splitlines())
    finally:
        kernel.stop()
    cells = cells_from(kernel_noted, {rank: json.loads(noted) for rank, noted in rank_noted.items()})
    print(f"empty %%fsdp2 cell on {args.ranks} CPU ranks, medians of {len(cells)} cells (us):")
    for step, measure in STEPS.items():
        print(f"  {step:>21}: {statistics.median(measure(cell) for cell in cells) * 1e6:7.0f}")


if __name__ == "__main__":
    main()
