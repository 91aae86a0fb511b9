"""Empty-cell overhead and pool cold start, measured side by side in one run.

- Added cost of an empty `%%fsdp2` cell: median over many runs of an empty `%%fsdp2` cell minus
  an empty plain cell, in the same kernel, through jupyter_client as a notebook would.
- CPU time per empty cell (all threads, from /proc/PID/task/*/schedstat), which scheduling noise
  does not move: what a `%%fsdp2` cell adds in the kernel over a plain cell, and what each rank
  spends. On a machine with few cores this work is what the added wall time cannot go below.
- Cold start: `%fsdp2 start --cpu N` until every rank has joined the process group, beside
  `torchrun` of a script that imports torch and initialises the same gloo process group.
- On 2 ranks: the stop button until the cell has ended (KeyboardInterrupt on every rank), and a
  rank's death until its cell has ended.
Run: .venv/bin/python benchmarks/bench_pool.py [--runs 100]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp2nb.testing.kernel_client import Kernel  # noqa: E402

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
"""


def cell_ms(kernel: Kernel, code: str) -> float:
    started = time.perf_counter()
    run = kernel.execute(code)
    elapsed = (time.perf_counter() - started) * 1000
    assert run.status == "ok", run.traceback_text
    return elapsed


def paired_cell_ms(kernel: Kernel, runs: int) -> tuple[float, float, float]:
    """Plain and %%fsdp2 cells alternate, so drift of a shared machine hits both alike.

    Returns the median plain cell, the median %%fsdp2 cell and the median of the per-pair
    differences.
    """
    plain, fsdp2, added = [], [], []
    for _ in range(runs):
        plain.append(cell_ms(kernel, "pass"))
        fsdp2.append(cell_ms(kernel, "%%fsdp2\npass"))
        added.append(fsdp2[-1] - plain[-1])
    return statistics.median(plain), statistics.median(fsdp2), statistics.median(added)


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of `pid` so far (schedstat: nanoseconds on a CPU)."""
    total = 0
    for stat in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(stat) as f:
                total += int(f.read().split()[0])
        except OSError:
            pass  # the thread ended
    return total


def cpu_per_cell_us(kernel: Kernel, runs: int) -> tuple[float, float]:
    """(CPU a %%fsdp2 cell adds in the kernel over a plain cell, CPU of each rank per cell), µs."""
    kernel_pid = int(kernel.execute("import os; print(os.getpid())").stdout)
    rank_pids = [int(line.split()[-1]) for line in
                 kernel.execute("%%fsdp2\nimport os; print(os.getpid())").stdout.splitlines()]
    pids = (kernel_pid, *rank_pids)
    spent = {}
    for code in ("pass", "%%fsdp2\npass"):
        before = [cpu_ns(pid) for pid in pids]
        for _ in range(runs):
            kernel.execute(code)
        spent[code] = [(cpu_ns(pid) - start) / runs / 1e3 for pid, start in zip(pids, before, strict=True)]
    added_kernel = spent["%%fsdp2\npass"][0] - spent["pass"][0]
    return added_kernel, statistics.mean(spent["%%fsdp2\npass"][1:])


def pool_cold_start_s(kernel: Kernel, num_ranks: int) -> float:
    kernel.execute("%fsdp2 stop")
    started = time.perf_counter()
    run = kernel.execute(f"%fsdp2 start --cpu {num_ranks}")
    elapsed = time.perf_counter() - started
    assert run.status == "ok", run.stderr
    return elapsed


def torchrun_cold_start_s(num_ranks: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(TORCHRUN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    started = time.perf_counter()
    subprocess.run([torchrun, "--standalone", f"--nproc_per_node={num_ranks}", script.name],
                   check=True, env=env, capture_output=True)
    elapsed = time.perf_counter() - started
    os.unlink(script.name)
    return elapsed


def seconds_after_output(kernel: Kernel, code: str, marker: str, press_stop: bool) -> float:
    """Seconds from the moment `marker` first arrives from the cell (the stop button pressed
    then, if asked) until the cell has ended; the cell must fail."""
    seen: list[float] = []

    def on_message(message: dict) -> None:
        if not seen and message["msg_type"] == "stream" and marker in message["content"]["text"]:
            seen.append(time.perf_counter())
            if press_stop:
                kernel.manager.interrupt_kernel()

    run = kernel.execute(code, on_message=on_message)
    ended = time.perf_counter()
    assert run.status == "error" and seen, run.stdout
    return ended - seen[0]


def failure_handling_s(kernel: Kernel, times: int) -> tuple[float, float]:
    """Median seconds from the stop button to the end of a cell sleeping on every rank, and from
    a rank's death to the end of its cell (the pool restarted included)."""
    interrupt = [seconds_after_output(kernel, "%%fsdp2\nimport time\nprint('waiting', flush=True)\ntime.sleep(60)",
                                      "waiting", press_stop=True) for _ in range(times)]
    # What a rank prints just before it dies may die with it: it says so 0.2 s ahead.
    death = [seconds_after_output(kernel, "%%fsdp2\nimport os, time\nif rank == 1:\n"
                                          "    print('dying', flush=True); time.sleep(0.2); os.kill(os.getpid(), 9)\n"
                                          "time.sleep(60)", "dying", press_stop=False) - 0.2 for _ in range(times)]
    return statistics.median(interrupt), statistics.median(death)


def alternating_starts(kernel: Kernel, num_ranks: int, starts: int) -> tuple[list[float], list[float]]:
    """Pool and torchrun start times, alternating, after one untimed start of each: whichever
    went first would otherwise pay alone for reading torch from a cold page cache."""
    pool_cold_start_s(kernel, num_ranks)
    torchrun_cold_start_s(num_ranks)
    pool_starts, torchrun_starts = [], []
    for _ in range(starts):
        pool_starts.append(pool_cold_start_s(kernel, num_ranks))
        torchrun_starts.append(torchrun_cold_start_s(num_ranks))
    return pool_starts, torchrun_starts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    kernel = Kernel()
    rows = []
    try:
        kernel.execute("%load_ext fsdp2nb")
        for num_ranks in (2, 4):
            pool_starts, torchrun_starts = alternating_starts(kernel, num_ranks, args.starts)
            kernel.execute("%%fsdp2\npass")  # warm the cell path once
            plain, empty, added = paired_cell_ms(kernel, args.runs)
            kernel_cpu, rank_cpu = cpu_per_cell_us(kernel, args.runs)
            if num_ranks == 2:
                interrupt_s, death_s = failure_handling_s(kernel, times=3)
            rows.append((num_ranks, plain, empty, added, kernel_cpu, rank_cpu, statistics.median(pool_starts),
                         statistics.median(torchrun_starts)))
    finally:
        kernel.stop()
    print(f"\nempty cell (body `pass`): {args.runs} alternating plain/%%fsdp2 pairs, added = median of the"
          f" pair differences; cold start: median of {args.starts} starts each, alternating, after one"
          " untimed start of each")
    print(f"{'ranks':>5} {'plain ms':>9} {'%%fsdp2 ms':>11} {'added ms':>9} {'kernel cpu us':>14} "
          f"{'rank cpu us':>12} {'pool start s':>13} {'torchrun s':>11} {'ratio':>6}")
    for num_ranks, plain, empty, added, kernel_cpu, rank_cpu, pool_s, torchrun_s in rows:
        print(f"{num_ranks:>5} {plain:>9.2f} {empty:>11.2f} {added:>9.2f} {kernel_cpu:>14.0f} {rank_cpu:>12.0f} "
              f"{pool_s:>13.2f} {torchrun_s:>11.2f} {pool_s / torchrun_s:>6.2f}")
    print("kernel cpu: CPU time a %%fsdp2 cell adds in the kernel process over a plain cell (all threads);"
          " rank cpu: per rank per cell")
    print(f"2 ranks, median of 3: stop button -> cell ended {interrupt_s:.2f} s; rank killed -> cell ended "
          f"{death_s:.2f} s (the pool restarted within it)")
    print("goals: added <= 1.5 ms on 2 ranks; cold start ratio <= 0.6; interrupt within 1 s; a dead rank "
          "ends its cell within seconds")


if __name__ == "__main__":
    main()
