"""The empty-cell cost of this working tree against an earlier revision, side by side.

A shared 2-core machine moves the added cost of an empty `%%fsdp2` cell by a third between
runs, more than most changes do. This starts two kernels at once, one importing fsdp2nb from
REV (extracted with `git archive`) and one from the working tree, and interleaves their cells,
so both see the same machine: each round is a plain and a `%%fsdp2` cell in each kernel, in
alternating order.
Run: .venv/bin/python benchmarks/compare_empty_cell.py REV [--ranks 2] [--rounds 150]
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
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as earlier:
        extract_revision(args.revision, earlier)
        kernels = {args.revision: kernel_on_tree(earlier), "working tree": kernel_on_tree(ROOT)}
        try:
            for kernel in kernels.values():
                kernel.execute("%load_ext fsdp2nb")
                cell_s(kernel, f"%%fsdp2 --cpu {args.ranks}\npass")
            added = {name: [] for name in kernels}
            for round_index in range(args.rounds):
                order = list(kernels.items())
                for name, kernel in order if round_index % 2 else reversed(order):
                    plain = cell_s(kernel, "pass")
                    added[name].append(cell_s(kernel, "%%fsdp2\npass") - plain)
        finally:
            for kernel in kernels.values():
                kernel.stop()
    print(f"\nempty %%fsdp2 cell on {args.ranks} ranks, added over a plain cell: median of {args.rounds} rounds")
    for name, values in added.items():
        print(f"{name:>14}: {statistics.median(values) * 1000:.2f} ms")
    differences = [new - old for old, new in zip(*added.values(), strict=True)]
    print(f"{'difference':>14}: {statistics.median(differences) * 1000:+.2f} ms (median of the per-round differences)")


if __name__ == "__main__":
    main()
