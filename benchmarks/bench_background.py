"""Background runs (`%%fsdp2 --bg`) against blocking cells, in one kernel on 2 CPU ranks.

- Start: wall time of an empty `--bg` cell (it returns once the request is sent) beside an empty
  blocking cell, alternating; the run is waited for, untimed, before the next pair.
- Streaming: the kernel's CPU (all threads, /proc schedstat) while the ranks print about 1 MB/s
  of distinct lines for a few seconds, as a blocking cell and as a background run. Every byte is
  received and merged, but a cell shows at most 200,000 characters per rank (render.py), so
  after the first 0.4 s the text is dropped rather than published.
Run: .venv/bin/python benchmarks/bench_background.py [--pairs 40] [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_pool import cell_ms, cpu_ns
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

# Every 10 ms each of 2 ranks prints 50 lines of 100 characters: about 1 MB/s in all.
STREAM = ("import time\nline = f'{rank}' * 99\nend = time.monotonic() + {seconds}\n"
          "while time.monotonic() < end:\n    print('\\n'.join([line] * 50), flush=True)\n    time.sleep(0.01)\n")


def start_ms(kernel: Kernel, pairs: int) -> tuple[float, float]:
    """Median wall time of an empty blocking cell and of an empty --bg cell, alternating."""
    blocking, background = [], []
    for _ in range(pairs):
        blocking.append(cell_ms(kernel, "%%fsdp2\npass"))
        background.append(cell_ms(kernel, "%%fsdp2 --bg\npass"))
        kernel.execute("%fsdp2 wait")
    return statistics.median(blocking), statistics.median(background)


def streaming_cpu_percent(kernel: Kernel, kernel_pid: int, seconds: float, background: bool) -> float:
    """Kernel CPU (percent of one core) while the ranks stream for `seconds`."""
    code = STREAM.replace("{seconds}", str(seconds))
    before, started = cpu_ns(kernel_pid), time.perf_counter()
    if background:
        kernel.execute(f"%%fsdp2 --bg\n{code}")
        assert kernel.execute("%fsdp2 wait").status == "ok"
        kernel.other_messages.clear()  # the run's output, read while waiting
    else:
        assert kernel.execute(f"%%fsdp2\n{code}").status == "ok"
    return (cpu_ns(kernel_pid) - before) / 1e9 / (time.perf_counter() - started) * 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    kernel = Kernel(env=WITHOUT_GPUS)
    try:
        kernel.execute("%load_ext fsdp2nb")
        kernel.execute("%fsdp2 start --cpu 2 --no-dashboard")
        kernel_pid = int(kernel.execute("import os; print(os.getpid())").stdout)
        kernel.execute("%%fsdp2\npass")  # warm both paths once
        kernel.execute("%%fsdp2 --bg\npass")
        blocking_ms, background_ms = start_ms(kernel, args.pairs)
        cpu = {bg: streaming_cpu_percent(kernel, kernel_pid, args.seconds, bg) for bg in (False, True)}
    finally:
        kernel.stop()
    print(f"empty cell, median of {args.pairs} alternating pairs: blocking {blocking_ms:.2f} ms, "
          f"--bg {background_ms:.2f} ms (returns once sent)")
    print(f"kernel CPU while 2 ranks stream ~1 MB/s for {args.seconds:g} s: blocking {cpu[False]:.1f}%, "
          f"--bg {cpu[True]:.1f}% of a core")
    print("goals: --bg start <= blocking start; --bg streaming kernel CPU < 10% of a core")


if __name__ == "__main__":
    main()
