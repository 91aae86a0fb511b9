"""pdb on a rank against pdb in a plain cell, through one real kernel on 2 CPU ranks.

- Prompt: from `breakpoint()` on the rank, or `pdb.set_trace()` in the plain cell (the monotonic
  clock read just before it) to the `input_request` reaching the client: what a user waits for
  the `(Pdb)` box.
- Round trip: from sending `p 1` to the next `input_request`: one debugger command.
Both are measured for a `%%fsdp2 --ranks 0` cell and for a plain cell, alternating, in one run.
Run: .venv/bin/python -m benchmarks.bench_debugger [--sessions 15] [--commands 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

RANK_CELL = "%%fsdp2 --ranks 0\nimport time\nstarted = time.monotonic()\nbreakpoint()\nprint(repr(started))"
# In a plain ipykernel cell breakpoint() calls debugpy's hook (it waits for a debug client, no
# prompt): the baseline is what a user types there instead.
PLAIN_CELL = "import pdb, time\nstarted = time.monotonic()\npdb.set_trace()\nprint(repr(started))"


def debugger_session(kernel: Kernel, cell: str, commands: int) -> tuple[float, list[float]]:
    """One breakpoint: ms until its prompt, and ms per `p 1` round trip; ends with `c`."""
    client = kernel.client
    msg_id = client.execute(cell, allow_stdin=True)
    client.get_stdin_msg(timeout=60)
    prompted = time.monotonic()
    round_trips = []
    for _ in range(commands):
        sent = time.monotonic()
        client.input("p 1")
        client.get_stdin_msg(timeout=60)
        round_trips.append((time.monotonic() - sent) * 1000)
    client.input("c")
    run = kernel.collect(msg_id, cell)
    assert run.status == "ok", run.traceback_text
    started = float(run.stdout.splitlines()[-1].removeprefix("[0] "))  # one monotonic clock for all processes
    return (prompted - started) * 1000, round_trips


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=15)
    parser.add_argument("--commands", type=int, default=10)
    args = parser.parse_args()
    kernel = Kernel(env=WITHOUT_GPUS)
    prompts: dict[str, list[float]] = {"rank": [], "plain": []}
    trips: dict[str, list[float]] = {"rank": [], "plain": []}
    try:
        kernel.execute("%load_ext fsdp2nb")
        kernel.execute("%fsdp2 start --cpu 2 --no-dashboard")
        for _where, cell in (("rank", RANK_CELL), ("plain", PLAIN_CELL)):  # warm pdb's imports on both
            debugger_session(kernel, cell, 1)
        for _ in range(args.sessions):
            for where, cell in (("rank", RANK_CELL), ("plain", PLAIN_CELL)):
                prompt_ms, round_trips = debugger_session(kernel, cell, args.commands)
                prompts[where].append(prompt_ms)
                trips[where].extend(round_trips)
    finally:
        kernel.stop()
    rank_prompt, plain_prompt = statistics.median(prompts["rank"]), statistics.median(prompts["plain"])
    rank_trip, plain_trip = statistics.median(trips["rank"]), statistics.median(trips["plain"])
    print(f"breakpoint() to prompt, median of {args.sessions}: rank 0 of 2 {rank_prompt:.1f} ms, "
          f"plain cell {plain_prompt:.1f} ms ({rank_prompt / plain_prompt:.2f}x)")
    print(f"one pdb command (p 1) round trip, median of {args.sessions * args.commands}: rank {rank_trip:.1f} ms, "
          f"plain cell {plain_trip:.1f} ms ({rank_trip / plain_trip:.2f}x)")
    print("goals: prompt <= 50 ms on a rank; round trip <= 20 ms")


if __name__ == "__main__":
    main()
