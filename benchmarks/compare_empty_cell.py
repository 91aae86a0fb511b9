"""The empty-cell cost of this working tree against an earlier revision, side by side.

A shared 2-core machine moves the added cost of an empty `%%fsdp2` cell by a third between
runs, more than most changes do. This starts two kernels at once, one importing fsdp2nb from
REV (extracted with `git archive`) and one from the working tree, and alternates between them
in short blocks, so both see the same machine: in each block one kernel starts its pool, runs
a few cells to warm up, then pairs of a plain and a `%%fsdp2` cell in alternating order, and
stops its pool. Only one pool runs at a time: idle ranks still wake (gloo's loop thread, 100
times a second), and would disturb the other kernel's cells, unequally where the revisions
schedule their ranks differently.
Run: .venv/bin/python benchmarks/compare_empty_cell.py REV [--ranks 2] [--blocks 10] [--pairs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tests.support.kernel_client import Kernel  # noqa: E402

SETTLE_S = 4.0
"""After a pool starts, the standby agent it starts for its next restart imports torch: seconds
of CPU, which the timed cells must not share."""


def kernel_on_tree(source_root: str) -> Kernel:
    """A kernel that imports fsdp2nb from `source_root` (through PYTHONPATH, from a neutral cwd)."""
    return Kernel(env={"PYTHONPATH": source_root}, cwd=tempfile.gettempdir())


def extract_revision(revision: str, into: str) -> None:
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision, "fsdp2nb"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)


def cell_s(kernel: Kernel, code: str) -> float:
    started = time.perf_counter()
    run = kernel.execute(code)
    assert run.status == "ok", run.traceback_text
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("revision")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=10, help="blocks per kernel, alternating")
    parser.add_argument("--pairs", type=int, default=30, help="plain and %%%%fsdp2 cell pairs per block")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as earlier:
        extract_revision(args.revision, earlier)
        kernels = {args.revision: kernel_on_tree(earlier), "working tree": kernel_on_tree(ROOT)}
        added: dict[str, list[float]] = {name: [] for name in kernels}
        block_medians: dict[str, list[float]] = {name: [] for name in kernels}
        try:
            for kernel in kernels.values():
                kernel.execute("%load_ext fsdp2nb")
            for block in range(args.blocks):
                order = list(kernels.items())
                for name, kernel in order if block % 2 else reversed(order):
                    block_added = added_in_a_block(kernel, args.ranks, args.pairs)
                    added[name] += block_added
                    block_medians[name].append(statistics.median(block_added))
        finally:
            for kernel in kernels.values():
                kernel.stop()
    print(f"\nempty %%fsdp2 cell on {args.ranks} ranks, added over a plain cell, one pool at a time: "
          f"{args.blocks} blocks of {args.pairs} pairs per revision")
    for name, values in added.items():
        print(f"{name:>14}: {statistics.median(values) * 1000:.2f} ms (median of every pair)")
    differences = [new - old for old, new in zip(*block_medians.values(), strict=True)]
    lower = sum(difference < 0 for difference in differences)
    print(f"{'difference':>14}: {statistics.median(differences) * 1000:+.2f} ms (median of the per-block "
          f"differences; the working tree lower in {lower} of {len(differences)} blocks)")


def added_in_a_block(kernel: Kernel, num_ranks: int, num_pairs: int) -> list[float]:
    """Start the kernel's pool, let it settle, warm up, time `num_pairs` pairs, stop the pool."""
    cell_s(kernel, f"%fsdp2 start --cpu {num_ranks} --no-dashboard")
    try:
        time.sleep(SETTLE_S)
        for _ in range(10):
            cell_s(kernel, "%%fsdp2\npass")
        added = []
        for pair in range(num_pairs):
            if pair % 2:
                plain = cell_s(kernel, "pass")
                added.append(cell_s(kernel, "%%fsdp2\npass") - plain)
            else:
                fsdp2 = cell_s(kernel, "%%fsdp2\npass")
                added.append(fsdp2 - cell_s(kernel, "pass"))
        return added
    finally:
        cell_s(kernel, "%fsdp2 stop")


if __name__ == "__main__":
    main()
