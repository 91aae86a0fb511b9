"""Small exchanges between CPU ranks: `collectives.all_gathered` and `all_gathered_objects` (among
more than two ranks a gather to the first rank and a broadcast from it) against gloo's ring-shaped
all_gather, all_reduce and all_gather_object.

What `fsdp2nb.generate`, `fsdp2nb.evaluate` and every "did all ranks succeed" step pay per call:
a few integers, or a pickled list of strings, from every rank to every rank. On a pool of CPU ranks
started from a real kernel; each exchange runs after a barrier, the kinds interleaved round by
round, and rank 0's median is printed per kind.
Run: .venv/bin/python -m benchmarks.bench_exchanges [--ranks 2 4] [--rounds 40]
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_trainer import load_average
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

MEASURE = """
import statistics, time
from fsdp2nb.collectives import all_gathered, all_gathered_objects
facts = torch.zeros(8, dtype=torch.int64)
texts = ["a completion of a few words"] * 8
ways = {
    "all_gathered": lambda: all_gathered(facts),
    "all_gathered_objects": lambda: all_gathered_objects(texts),
    "dist.all_gather": lambda: dist.all_gather([torch.empty_like(facts) for _ in range(world_size)], facts),
    "dist.all_reduce": lambda: dist.all_reduce(facts.clone()),
    "dist.all_gather_object": lambda: dist.all_gather_object([None] * world_size, texts),
}
seconds = {name: [] for name in ways}
for _ in range(ROUNDS):
    for name, run in ways.items():
        dist.barrier()
        started = time.perf_counter()
        run()
        seconds[name].append(time.perf_counter() - started)
if rank == 0:
    for name, values in seconds.items():
        print(f"RESULT {name}: {statistics.median(values) * 1000:.2f} ms")
"""


def measure(num_ranks: int, rounds: int) -> list[str]:
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        kernel.execute("%load_ext fsdp2nb")
        if kernel.execute(f"%fsdp2 start --cpu {num_ranks} --no-dashboard").status != "ok":
            raise RuntimeError("the pool did not start")
        run = kernel.execute(f"%%fsdp2\nROUNDS = {rounds}\n" + MEASURE, timeout=600)
        if run.status != "ok":
            raise RuntimeError(f"the cell failed:\n{run.traceback_text}")
        return re.findall(r"RESULT (.*)", run.stdout)
    finally:
        kernel.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pool sizes (CPU ranks)")
    parser.add_argument("--rounds", type=int, default=40, help="runs of each exchange, interleaved")
    args = parser.parse_args()
    print(f"load average before: {load_average()}, {os.cpu_count()} cores")
    for num_ranks in args.ranks:
        print(f"\n{num_ranks} CPU ranks, median of {args.rounds} (rank 0):")
        for line in measure(num_ranks, args.rounds):
            print(f"  {line}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
