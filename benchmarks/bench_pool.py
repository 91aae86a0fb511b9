"""Empty-cell overhead and pool cold start, measured side by side in one run.

- Added cost of an empty `%%fsdp2` cell: median over many runs of an empty `%%fsdp2` cell minus
  an empty plain cell, in the same kernel, through jupyter_client as a notebook would.
- CPU time per empty cell (all threads, from /proc/PID/task/*/schedstat), which scheduling noise
  does not move: what a `%%fsdp2` cell adds in the kernel over a plain cell, and what each rank
  spends. On a machine with few cores this work is what the added wall time cannot go below.
- Cold start: `%fsdp2 start --cpu N` until every rank has joined the process group, beside
  `torchrun` of a script that imports torch and initialises the same gloo process group.
- Warm restart: `%fsdp2 restart` of a running pool (the old pool's stop included) until every
  new rank has joined a new process group, once the standby agent it forks from has imported
  torch; beside the cold start, alternating, with the ratio.
- On 2 ranks: the stop button until the cell has ended (KeyboardInterrupt on every rank), and a
  rank's death or its host agent's until the cell has ended (the pool restarted from the standby
  within it), also as a ratio to the cold start.
- First start: a fresh kernel loads the extension (which starts the standby agent), the user
  pauses, then `%fsdp2 start --cpu N`; also with no pause, and with `FSDP2NB_STANDBY=0`; each
  beside a fresh `python -c "import torch"`, alternating, as a ratio to it.
- Attach: `%fsdp2 attach` of a kept 2-rank pool holding a model (its kernel killed), beside what
  it replaces: a cold start plus loading the same model from disk again.
Run: .venv/bin/python benchmarks/bench_pool.py [--runs 100] [--only-starts] [--only-attach]
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
from tests.support.kernel_client import Kernel

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


def wait_for_standby(kernel: Kernel, timeout_s: float = 60.0) -> None:
    """Until the standby agent has imported torch and sleeps waiting for its plan: its CPU time
    stops growing. A restart sooner than that waits for the rest of the import."""
    run = kernel.execute("from fsdp2nb import _session\nprint(_session.launcher.standby_pid())")
    pid = int(run.stdout)
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        now = cpu_ns(pid)
        if now == last:
            return
        last = now
        time.sleep(0.3)
    raise TimeoutError(f"the standby agent (pid {pid}) was still busy after {timeout_s:.0f} s")


def warm_restart_s(kernel: Kernel) -> float:
    """`%fsdp2 restart` of the running pool, from a standby agent that is ready."""
    wait_for_standby(kernel)
    started = time.perf_counter()
    run = kernel.execute("%fsdp2 restart")
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


def failure_handling_s(kernel: Kernel, times: int) -> tuple[float, float, float]:
    """Median seconds from the stop button to the end of a cell sleeping on every rank, and from
    a rank's death and from the host agent's to the end of the cell (the pool restarted included)."""
    interrupt = [seconds_after_output(kernel, "%%fsdp2\nimport time\nprint('waiting', flush=True)\ntime.sleep(60)",
                                      "waiting", press_stop=True) for _ in range(times)]
    # What a rank prints just before it dies may die with it: it says so 0.2 s ahead.
    deaths: dict[str, list[float]] = {"os.getpid()": [], "os.getppid()": []}
    for _ in range(times):
        for victim, seconds in deaths.items():
            wait_for_standby(kernel)  # as when a rank dies more than a few seconds after the last restart
            seconds.append(seconds_after_death(kernel, victim))
    return statistics.median(interrupt), *(statistics.median(seconds) for seconds in deaths.values())


def seconds_after_death(kernel: Kernel, victim: str) -> float:
    """From the SIGKILL of rank 1's `victim` (itself, or its host agent) until the cell has ended,
    the pool restarted within it. The rank says when it will kill (the clock is the same
    machine's): what a rank prints just before it dies may die with it, and when it reaches the
    client is up to the kernel's output batching."""
    run = kernel.execute("%%fsdp2\nimport os, time\nif rank == 1:\n    dies_at = time.time() + 0.2\n"
                         "    print('dying at', dies_at, flush=True); time.sleep(dies_at - time.time())\n"
                         f"    os.kill({victim}, 9)\ntime.sleep(60)")
    ended = time.time()
    assert run.status == "error" and "dying at" in run.stdout, run.stdout
    return ended - float(run.stdout.split("dying at")[1].split()[0])


USER_PAUSE_S = 4.0
"""How long the first-start rows let a user take between `%load_ext fsdp2nb` and the first cell."""


def import_torch_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def first_start_s(num_ranks: int, pause_s: float, env: dict[str, str] | None = None) -> float:
    """A fresh kernel: `%load_ext fsdp2nb`, `pause_s` of a user's time, then the timed start."""
    kernel = Kernel(env=env)
    try:
        kernel.execute("%load_ext fsdp2nb")
        time.sleep(pause_s)
        started = time.perf_counter()
        run = kernel.execute(f"%fsdp2 start --cpu {num_ranks} --no-dashboard")
        elapsed = time.perf_counter() - started
        assert run.status == "ok", run.stderr
        return elapsed
    finally:
        kernel.stop()


FIRST_START_WAYS = {"after a pause": dict(pause_s=USER_PAUSE_S), "right after load": dict(pause_s=0.0),
                    "FSDP2NB_STANDBY=0": dict(pause_s=USER_PAUSE_S, env={"FSDP2NB_STANDBY": "0"})}


def first_starts(num_ranks: int, rounds: int) -> dict[str, list[float]]:
    """Each round: `import torch`, then each way of a first start; ratios to that round's import."""
    import_torch_s()  # untimed: reads torch into the page cache
    ratios: dict[str, list[float]] = {way: [] for way in FIRST_START_WAYS}
    for _ in range(rounds):
        reference = import_torch_s()
        for way, settings in FIRST_START_WAYS.items():
            ratios[way].append(first_start_s(num_ranks, **settings) / reference)
    return ratios


def print_first_starts(ratios: dict[int, dict[str, list[float]]]) -> None:
    print("\nfirst start (`%load_ext fsdp2nb`, then `%fsdp2 start`), as a ratio to `import torch` in the same "
          "round; median (rounds):")
    for num_ranks, ways in ratios.items():
        print(f"{num_ranks:>5} ranks: " + "; ".join(
            f"{way} {statistics.median(values):.2f}x ({', '.join(f'{v:.2f}' for v in values)})"
            for way, values in ways.items()))
    print(f"after a pause: {USER_PAUSE_S:g} s between loading and the first start. goal: <= 1.2x import torch")


def alternating_starts(kernel: Kernel, num_ranks: int, starts: int) -> tuple[list[float], list[float], list[float]]:
    """Pool cold start, warm restart and torchrun start times, alternating, after one untimed
    start of each: whichever went first would otherwise pay alone for reading torch from a cold
    page cache. `%fsdp2 stop` before each cold start ends the standby, so that start is cold."""
    pool_cold_start_s(kernel, num_ranks)
    warm_restart_s(kernel)
    torchrun_cold_start_s(num_ranks)
    pool_starts, warm_restarts, torchrun_starts = [], [], []
    for _ in range(starts):
        pool_starts.append(pool_cold_start_s(kernel, num_ranks))
        warm_restarts.append(warm_restart_s(kernel))
        torchrun_starts.append(torchrun_cold_start_s(num_ranks))
    return pool_starts, warm_restarts, torchrun_starts


def print_starts(starts: dict[int, tuple[list[float], list[float], list[float]]]) -> None:
    print(f"\n{'ranks':>5} {'cold start s':>13} {'torchrun s':>11} {'cold/torchrun':>14} {'restart s':>10} "
          f"{'restart/cold':>13}   restarts")
    for num_ranks, (cold, warm, torchrun) in starts.items():
        cold_s, warm_s, torchrun_s = map(statistics.median, (cold, warm, torchrun))
        print(f"{num_ranks:>5} {cold_s:>13.2f} {torchrun_s:>11.2f} {cold_s / torchrun_s:>14.2f} {warm_s:>10.3f} "
              f"{warm_s / cold_s:>13.2f}   {', '.join(f'{s:.3f}' for s in warm)}")
    print("medians of alternating starts, after one untimed start of each; restart: `%fsdp2 restart` of a running"
          " pool, its stop included, from a standby agent that has imported torch. goals: cold/torchrun <= 0.6,"
          " restart/cold <= 0.25")


_MODEL_CELL = """%%fsdp2
import torch
state = torch.load({path!r}, mmap=False)
model = torch.nn.Sequential(*[torch.nn.Linear({width}, {width}) for _ in range({depth})])
model.load_state_dict(state)
"""


def attach_vs_reload_s(width: int = 1024, depth: int = 24) -> tuple[float, float, float]:
    """Attach of a kept pool with a model loaded, against a cold start plus the model's load.

    Returns the attach, the cold start and the load, in seconds."""
    import signal

    root = tempfile.mkdtemp(prefix="kp-bench-")
    path = os.path.join(root, "model.pt")
    env = {"TMPDIR": root, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-c", "import torch; torch.save(torch.nn.Sequential(*[torch.nn.Linear("
                    f"{width}, {width}) for _ in range({depth})]).state_dict(), {path!r})"], check=True)
    first = Kernel(env=env)
    try:
        first.execute("%load_ext fsdp2nb")
        started = time.perf_counter()
        assert first.execute("%fsdp2 start --cpu 2 --keep --name bench --no-dashboard").status == "ok"
        cold_s = time.perf_counter() - started
        load_s = cell_ms(first, _MODEL_CELL.format(path=path, width=width, depth=depth)) / 1000
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.stop()
    second = Kernel(env=env)
    try:
        second.execute("%load_ext fsdp2nb")
        attach_s = cell_ms(second, "%fsdp2 attach bench --no-dashboard") / 1000
        assert second.execute("%%fsdp2\nmodel").status == "ok"
        second.execute("%fsdp2 stop")
    finally:
        second.stop()
    return attach_s, cold_s, load_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--only-starts", action="store_true", help="only the cold start and warm restart rows")
    parser.add_argument("--only-attach", action="store_true", help="only the attach of a kept pool")
    parser.add_argument("--only-first-start", action="store_true", help="only the first start from a fresh kernel")
    args = parser.parse_args()
    print_first_starts({num_ranks: first_starts(num_ranks, args.starts) for num_ranks in (2, 4)})
    if args.only_first_start:
        return
    attach_s, cold_s, load_s = attach_vs_reload_s()
    print(f"kept pool, 2 CPU ranks, a 24 x Linear(1024) model (100 MB) loaded: attach {attach_s:.2f} s; "
          f"it replaces a cold start {cold_s:.2f} s + reload {load_s:.2f} s ({attach_s / (cold_s + load_s):.2f}x)")
    if args.only_attach:
        return
    kernel = Kernel()
    rows = []
    starts = {}
    try:
        kernel.execute("%load_ext fsdp2nb")
        for num_ranks in (2, 4):
            pool_starts, warm_restarts, torchrun_starts = alternating_starts(kernel, num_ranks, args.starts)
            starts[num_ranks] = (pool_starts, warm_restarts, torchrun_starts)
            if args.only_starts:
                continue
            kernel.execute("%%fsdp2\npass")  # warm the cell path once
            plain, empty, added = paired_cell_ms(kernel, args.runs)
            kernel_cpu, rank_cpu = cpu_per_cell_us(kernel, args.runs)
            if num_ranks == 2:
                interrupt_s, death_s, agent_death_s = failure_handling_s(kernel, times=3)
            rows.append((num_ranks, plain, empty, added, kernel_cpu, rank_cpu))
    finally:
        kernel.stop()
    print_starts(starts)
    if args.only_starts:
        return
    print(f"\nempty cell (body `pass`): {args.runs} alternating plain/%%fsdp2 pairs, added = median of the"
          " pair differences")
    print(f"{'ranks':>5} {'plain ms':>9} {'%%fsdp2 ms':>11} {'added ms':>9} {'kernel cpu us':>14} {'rank cpu us':>12}")
    for num_ranks, plain, empty, added, kernel_cpu, rank_cpu in rows:
        print(f"{num_ranks:>5} {plain:>9.2f} {empty:>11.2f} {added:>9.2f} {kernel_cpu:>14.0f} {rank_cpu:>12.0f}")
    print("kernel cpu: CPU time a %%fsdp2 cell adds in the kernel process over a plain cell (all threads);"
          " rank cpu: per rank per cell")
    print(f"2 ranks, median of 3: stop button -> cell ended {interrupt_s:.2f} s; rank killed -> cell ended "
          f"{death_s:.2f} s, host agent killed -> cell ended {agent_death_s:.2f} s (the pool restarted from the "
          f"standby within it; {death_s / statistics.median(starts[2][0]):.2f}x and "
          f"{agent_death_s / statistics.median(starts[2][0]):.2f}x the 2-rank cold start)")
    print("goals: added <= 1.0 ms on 2 ranks and 0.1 ms more per extra rank; interrupt within 1 s; a dead rank "
          "ends its cell within seconds")
    print("empty cell, added over a plain cell as a ratio to its goal: " + ", ".join(
        f"{num_ranks} ranks {added / (1.0 + 0.1 * (num_ranks - 2)):.2f}x" for num_ranks, _, _, added, _, _ in rows))


if __name__ == "__main__":
    main()
