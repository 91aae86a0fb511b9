"""fsdp2nb beside the other notebook tools for distributed PyTorch, the same work in one run.

Peers: ipyparallel (`%%px`), jupyter-distributed (a proxy kernel over N rank kernels),
nbdistributed (`%dist_init`, `%%distributed`), accelerate (`notebook_launcher`, which forks its
ranks in every call) and Monarch (actors driven by endpoint calls). Each is driven through a real
kernel (jupyter_client) with the cells its docs show (`benchmarks/peer_drivers.py`); all run on
gloo CPU ranks with the same torch. Rows:
- empty cell: median over alternating pairs of the tool's empty cell minus a plain cell (in a plain
  kernel beside it), 2 and 4 ranks;
- cold start: from a fresh kernel until the first cell with torch imported and a group formed has
  ended, beside torchrun of a script that does the same;
- back after a crash: rank 1 is killed by its cell; until the first cell that finds torch and a
  formed group has ended again, through what the tool's docs say to do;
- training: the notebook's wall time of a cell running 20 DDP steps of a tiny MLP, less the same
  20 steps timed inside a torchrun script, per step;
- output: each rank prints 10 MB in 100-byte lines; until the cell has ended with all of it.
A tool that fails a step is reported as failed with its error, never as a number.
Run (after `make bench-peers` has set up .venv-peers): .venv-peers/bin/python -m benchmarks.peers
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_pool import torchrun_cold_start_s
from benchmarks.peer_drivers import DRIVERS, Driver, JupyterDistributed
from tests.support.kernel_client import CellRun, Kernel

OUTPUT_LINES = 100_000
"""Lines of 100 bytes each rank prints: 10 MB."""
TRAIN_STEPS = 20
CELL_TIMEOUT_S = 180.0

TRAIN_SETUP = """
import torch, torch.distributed as dist
torch.manual_seed(0)
net = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)))
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
batch = torch.randn(32, 64)  # (batch, features); the target is the input itself
for warm_up in range(3):  # DDP's first steps build its buckets: not the steady step
    net(batch).sum().backward()
    optimizer.zero_grad()
"""
TRAIN_LOOP = f"""
for step in range({TRAIN_STEPS}):
    loss = torch.nn.functional.mse_loss(net(batch), batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dist.barrier()
print(f'TRAINED-{{rank}}', flush=True)  # one write: some tools split a print's pieces
"""
PRINT_10MB = f"""
line = f'{{rank}}' + 'x' * 98  # lines differ between ranks, so none is merged with another's
for _ in range({OUTPUT_LINES}):
    print(line)
print(f'PRINTED-{{rank}}', flush=True)
"""
READY = "import torch, torch.distributed as dist\nassert dist.is_initialized()\nprint(f'READY-{rank}', flush=True)\n"
TORCHRUN_TRAIN = ("import sys, time, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                  "rank = dist.get_rank()\n" + TRAIN_SETUP + "dist.barrier()\nstarted = time.perf_counter()\n"
                  + TRAIN_LOOP + "if rank == 0:\n    open(sys.argv[1], 'w').write(str(time.perf_counter() - started))\n")
"""Rank 0 writes the loop's seconds to the file named by its argument: a file, not stdout, which
torchrun shares between its workers and its own messages."""


class PeerFailed(Exception):
    """A step of a peer did not do what it should; the message says what it did instead."""


@dataclass
class PeerResult:
    name: str
    values: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def run_text(run: CellRun) -> str:
    """The text a notebook shows of a cell once it has ended: streams, displays (an update
    replaces the display it names, as ipyparallel's streamed output does) and errors."""
    shown: list[str] = []
    display_at: dict[str, int] = {}
    for message in run.messages:
        kind, content = message["msg_type"], message["content"]
        display_id = content.get("transient", {}).get("display_id")
        if kind == "stream":
            shown.append(content["text"])
        elif kind == "update_display_data" and display_id in display_at:
            shown[display_at[display_id]] = str(content["data"].get("text/plain", ""))
        elif kind in ("display_data", "execute_result"):
            if display_id:
                display_at[display_id] = len(shown)
            shown.append(str(content["data"].get("text/plain", "")))
        elif kind == "error":
            shown.append(f"{content['ename']}: {content['evalue']}")
        elif kind == "clear_output":
            shown.clear()
            display_at.clear()
    return "".join(shown)


def timed_cell(kernel: Kernel, code: str, timeout: float | None = None) -> tuple[float, CellRun]:
    started = time.perf_counter()
    run = kernel.execute(code, timeout=timeout or CELL_TIMEOUT_S)
    return time.perf_counter() - started, run


def checked_cell(kernel: Kernel, code: str, marker: str | None = None, num_ranks: int = 0,
                 timeout: float | None = None) -> float:
    """Seconds the cell took; raises PeerFailed unless it ended well (and every rank printed
    `marker`, where the tool brings rank output to the notebook)."""
    seconds, run = timed_cell(kernel, code, timeout)
    text = run_text(run)
    if run.status != "ok":
        raise PeerFailed(_first_error_line(run, text))
    if marker and any(f"{marker}-{rank}" not in text for rank in range(num_ranks)):
        raise PeerFailed(f"not every rank printed {marker!r}: {_short(text)}")
    return seconds


def _first_error_line(run: CellRun, text: str) -> str:
    if run.error:
        return f"{run.error['ename']}: {_short(run.error['evalue'])}"
    return _short(text)


def _short(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().replace("\n", " | ")
    return text[:300] + ("..." if len(text) > 300 else "")


def kernel_env() -> dict[str, str]:
    """One thread per rank, as torchrun sets it; the environment's bin first on PATH, as an
    activated environment has it (nbdistributed starts its workers as `python`)."""
    bin_dir = os.path.dirname(sys.executable)
    return {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def start_kernel(driver: Driver) -> Kernel:
    if isinstance(driver, JupyterDistributed):
        return ProxyKernel(driver.kernel_argv())
    return Kernel(env=kernel_env())


class ProxyKernel(Kernel):
    """A kernel started from another command line, as jupyter-distributed's server extension
    starts its proxy (the extension also sets the world size through the environment)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv  # started by `launch`, once the number of ranks is known

    def launch(self, num_ranks: int) -> None:
        from jupyter_client.manager import KernelManager

        self.manager = KernelManager(kernel_name="python3")
        self.manager.kernel_spec.argv = self.argv
        self.manager.kernel_spec.interrupt_mode = "message"
        self.manager.start_kernel(env={**os.environ, **kernel_env(), "JUPYTER_DISTRIBUTED_WORLD_SIZE": str(num_ranks)})
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.other_messages, self._replies = [], {}


def run_cells(kernel: Kernel, cells: list[str]) -> None:
    for code in cells:
        checked_cell(kernel, code)


def cold_start_s(driver: Driver, kernel: Kernel, num_ranks: int) -> float:
    started = time.perf_counter()
    if isinstance(kernel, ProxyKernel):
        kernel.launch(num_ranks)  # jupyter-distributed starts its ranks with the kernel
    run_cells(kernel, driver.start_cells(num_ranks))
    checked_cell(kernel, driver.on_ranks(READY), "READY" if driver.shows_rank_output else None, num_ranks)
    return time.perf_counter() - started


def empty_cell_ms(driver: Driver, kernel: Kernel, plain_kernel: Kernel, runs: int, budget_s: float) -> float:
    """Median of (tool's empty cell - plain cell) over alternating pairs, `runs` pairs or as many
    as fit in `budget_s` (at least three): accelerate's cell forks its ranks and takes seconds.
    The plain cell runs in a kernel of its own: under jupyter-distributed and nbdistributed's
    distributed mode, a plain cell in the tool's kernel runs on the ranks too."""
    checked_cell(kernel, driver.empty_cell)  # once untimed: first-call costs are not per cell
    added, deadline = [], time.monotonic() + budget_s
    while len(added) < runs and (len(added) < 3 or time.monotonic() < deadline):
        plain = checked_cell(plain_kernel, "pass")
        added.append(checked_cell(kernel, driver.empty_cell) - plain)
    return statistics.median(added) * 1000


def train_overhead_ms(driver: Driver, kernel: Kernel, num_ranks: int, runs: int, torchrun_steps_ms: list) -> float:
    """Per step: the notebook's wall time of a 20-step cell less the same 20 steps timed inside
    torchrun, run right after it (so drift of a shared machine hits both); median over `runs`."""
    marker = "TRAINED" if driver.shows_rank_output else None
    if driver.persistent:
        checked_cell(kernel, driver.on_ranks(TRAIN_SETUP), num_ranks=num_ranks)
    overheads = []
    for _ in range(runs):
        cell = driver.on_ranks(TRAIN_LOOP if driver.persistent else TRAIN_SETUP + TRAIN_LOOP)
        cell_s = checked_cell(kernel, cell, marker, num_ranks)
        loop_s = torchrun_loop_s(num_ranks)
        torchrun_steps_ms.append(loop_s / TRAIN_STEPS * 1000)
        overheads.append((cell_s - loop_s) / TRAIN_STEPS * 1000)
    return statistics.median(overheads)


def output_s(driver: Driver, kernel: Kernel, num_ranks: int, result: PeerResult) -> float:
    """Until the cell has ended with every rank's 10 MB in the notebook, or, where the tool caps
    what a notebook shows (fsdp2nb: 200,000 characters a rank), in the log file it names."""
    if not driver.shows_rank_output:
        raise PeerFailed("rank output does not reach the notebook")
    seconds, run = timed_cell(kernel, driver.on_ranks(PRINT_10MB))
    text = run_text(run)
    if run.status != "ok":
        raise PeerFailed(_first_error_line(run, text))
    logs = dict(re.findall(r"\[(\d+)\] \.\.\. output truncated .*? the full output is in (\S+)", text))
    if logs:  # then the notebook shows a prefix of each rank's output, its log file all of it
        result.notes["output"] = "the notebook shows 200,000 characters a rank; the rest is in a log file it names"
        received = {rank: open(path).read() for rank, path in logs.items()}
        complete = all(text.count(f"{rank}" + "x" * 98) >= OUTPUT_LINES and f"PRINTED-{rank}" in text
                       for rank, text in received.items())
        if len(received) < num_ranks or not complete:
            raise PeerFailed("the log files lack some of the ranks' output")
        return seconds
    # Counted in characters: some tools break lines where their chunks end.
    expected, shown = 98 * OUTPUT_LINES * num_ranks, text.count("x")
    missing = [rank for rank in range(num_ranks) if f"PRINTED-{rank}" not in text]
    if shown < expected or missing:
        raise PeerFailed(f"{shown / expected:.1%} of the output reached the notebook by the cell's end"
                         + (f"; no last line from ranks {missing}" if missing else ""))
    return seconds


def back_after_crash_s(driver: Driver, kernel: Kernel, num_ranks: int) -> tuple[float, float]:
    """(seconds until the crashing cell ended, until the first cell after it found the group)."""
    started = time.perf_counter()
    _, run = timed_cell(kernel, driver.crash_cell)
    ended = time.perf_counter() - started
    if isinstance(kernel, ProxyKernel):
        kernel.manager.restart_kernel(now=True)  # the docs: a failed rank needs a kernel restart
        kernel.client.wait_for_ready(timeout=60)
    run_cells(kernel, driver.back_cells(num_ranks))
    checked_cell(kernel, driver.on_ranks(READY), "READY" if driver.shows_rank_output else None, num_ranks)
    return ended, time.perf_counter() - started


def torchrun_loop_s(num_ranks: int, tries: int = 2) -> float:
    """The 20 training steps timed inside a torchrun script (warmed up as the cells are). It is
    the reference, not a tool measured, so a run that left no figure is run once more."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as folder:
        script, figure = os.path.join(folder, "train.py"), os.path.join(folder, "loop_s")
        with open(script, "w") as file:
            file.write(TORCHRUN_TRAIN)
        for _ in range(tries):
            run = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={num_ranks}", script, figure],
                                 env=env, capture_output=True, text=True)
            if run.returncode == 0 and os.path.exists(figure):
                with open(figure) as file:
                    return float(file.read())
    last_lines = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
    raise PeerFailed(f"torchrun's reference run (exit {run.returncode}) left no figure: {_short(last_lines[0])}")


def measure(driver: Driver, result: PeerResult, num_ranks: int, args: argparse.Namespace,
            torchrun_steps_ms: list, plain_kernel: Kernel) -> None:
    """Every row of one tool at `num_ranks`, in one kernel; a failed row is kept as its error."""
    kernel = start_kernel(driver)

    stuck: list[str] = []

    def step(row: str, action) -> None:
        if result.errors.get(f"cold start, {num_ranks} ranks") and row != f"cold start, {num_ranks} ranks":
            result.errors[row] = "no group to run on (cold start failed)"
            return
        if stuck:
            result.errors[row] = f"not run: the kernel was still busy with the {stuck[0]} cell"
            return
        try:
            result.values[row] = action()
        except Exception as error:  # any failure of a peer is reported, not raised
            result.errors[row] = _short(f"{type(error).__name__}: {error}")
            if isinstance(error, TimeoutError) and not interrupted(kernel):
                stuck.append(row)
            print(f"  {driver.name}: {row} failed: {result.errors[row]}", file=sys.stderr)
            if args.verbose:
                traceback.print_exc()

    try:
        step(f"cold start, {num_ranks} ranks", lambda: cold_start_s(driver, kernel, num_ranks))
        step(f"empty cell, {num_ranks} ranks", lambda: empty_cell_ms(driver, kernel, plain_kernel, args.runs, args.budget_s))
        if num_ranks == 2:
            step("training", lambda: train_overhead_ms(driver, kernel, num_ranks, args.train_runs, torchrun_steps_ms))
            crash: list[float] = []
            step("crash: cell ended", lambda: crash.extend(back_after_crash_s(driver, kernel, num_ranks)) or crash[0])
            if crash:
                result.values["back after crash"] = crash[1]
            elif "crash: cell ended" in result.errors:
                result.errors["back after crash"] = result.errors["crash: cell ended"]
            step("output", lambda: output_s(driver, kernel, num_ranks, result))
        for code in driver.stop_cells():
            step("stop", lambda code=code: timed_cell(kernel, code, timeout=60)[0])
    finally:
        stop_kernel(kernel)


def interrupted(kernel: Kernel) -> bool:
    """Press the stop button on a cell that ran too long; whether the kernel came back."""
    kernel.manager.interrupt_kernel()
    try:
        return kernel.execute("pass", timeout=30).status == "ok"
    except TimeoutError:
        return False


def stop_kernel(kernel: Kernel) -> None:
    """Shut the kernel down; one a crash left hanging is killed."""
    if not hasattr(kernel, "manager"):
        return  # jupyter-distributed's proxy never started
    kernel.client.stop_channels()
    try:
        kernel.manager.shutdown_kernel(now=False)
    except Exception:  # whatever went wrong, the kernel must go
        kernel.manager.shutdown_kernel(now=True)


ROWS = (  # (key, label, unit, format)
    ("empty cell, 2 ranks", "empty cell, added over a plain cell, 2 ranks", "ms", "{:.1f}"),
    ("empty cell, 4 ranks", "empty cell, added over a plain cell, 4 ranks", "ms", "{:.1f}"),
    ("cold start, 2 ranks", "cold start to the first cell with torch and a group, 2 ranks", "s", "{:.2f}"),
    ("cold start, 4 ranks", "cold start to the first cell with torch and a group, 4 ranks", "s", "{:.2f}"),
    ("crash: cell ended", "rank 1 killed: until its cell has ended, 2 ranks", "s", "{:.2f}"),
    ("back after crash", "rank 1 killed: until the next cell finds the group, 2 ranks", "s", "{:.2f}"),
    ("training", "20 training steps: per-step overhead over torchrun, 2 ranks", "ms", "{:.1f}"),
    ("output", "10 MB printed per rank, until the notebook has it all, 2 ranks", "s", "{:.2f}"),
)


def cell_text(result: PeerResult, reference: PeerResult, key: str, fmt: str) -> str:
    if key in result.errors:
        return "failed"
    if key not in result.values:
        return "-"
    value, base = result.values[key], reference.values.get(key)
    text = fmt.format(value)
    if result is not reference and base and base > 0:
        text += f" ({value / base:.1f}x)"
    return text


def markdown_table(results: list[PeerResult], notes: list[str]) -> str:
    reference = results[0]
    lines = ["| | " + " | ".join(r.name for r in results) + " |", "|---" * (len(results) + 1) + "|"]
    for key, label, unit, fmt in ROWS:
        cells = [cell_text(r, reference, key, fmt) + ("*" if key in r.notes else "") for r in results]
        lines.append(f"| {label} ({unit}) | " + " | ".join(cells) + " |")
    starred = [f"\\* {r.name}: {note}" for r in results for note in r.notes.values()]
    failures = [f"- {r.name}, {key}: {error}" for r in results for key, error in r.errors.items()]
    return "\n".join(lines + [""] + starred + notes + (["", "Failed, with the error each tool gave:"] + failures
                                                      if failures else [])) + "\n"


MARKDOWN_HEAD = """# fsdp2nb beside other notebook tools for distributed PyTorch

Measured by `make bench-peers` (benchmarks/peers.py) in one run on one machine: every tool
through a real kernel with the cells its own docs show, on gloo CPU ranks with the same torch.
Lower is better in every row; `(Nx)` is the ratio to fsdp2nb. A tool that could not do a step
says `failed`, and its error is listed below the table.

- empty cell: the tool's empty cell less a plain cell in a plain kernel, median of alternating
  pairs
  (Monarch: an awaited call of an empty endpoint on every actor; accelerate: a
  `notebook_launcher` call, which forks its ranks every time).
- cold start: from a started kernel until the first cell that finds torch imported and a process
  group formed on every rank has ended (jupyter-distributed's includes its kernel's start, which
  starts the rank kernels; for the others a plain kernel's start, about a second, is left out).
- rank 1 killed: its cell kills rank 1 while the others sleep for a minute; until that cell has
  ended, and until the next cell finds a formed group again, through what the tool's docs say to
  do (ipyparallel: a new cluster; jupyter-distributed: restart the kernel; nbdistributed:
  `%dist_shutdown`, `%dist_init`; Monarch: new procs; fsdp2nb restarts its pool by itself).
- training: 20 steps of a small DDP MLP in one cell, the notebook's wall time less the same 20
  steps timed inside torchrun run right after it, per step (median of paired runs).
- output: every rank prints 10 MB in 100-byte lines; until the cell has ended with all of it.

"""


def installed(driver: Driver) -> str | None:
    """None when the tool imports here, else why not."""
    try:
        if importlib.util.find_spec(driver.module.split(".")[0]) is None:
            return f"{driver.package} is not installed here (make bench-peers installs it in .venv-peers)"
        __import__(driver.module)
    except Exception as error:  # an import that fails for any reason is reported
        return _short(f"{driver.package} does not import: {type(error).__name__}: {error}")
    return None


def measure_all(drivers: list[Driver], sizes: list[int], args: argparse.Namespace, results: list[PeerResult],
                torchrun_steps_ms: list, plain_kernel: Kernel) -> None:
    for driver in drivers:
        result = PeerResult(driver.name)
        results.append(result)
        missing = installed(driver)
        if missing:
            result.errors = {key: missing for key, *_ in ROWS}
            print(f"{driver.name}: {missing}", file=sys.stderr)
            continue
        for num_ranks in sizes:
            print(f"{driver.name} on {num_ranks} ranks ...", file=sys.stderr, flush=True)
            measure(driver, result, num_ranks, args, torchrun_steps_ms, plain_kernel)


def main(argv: list[str] | None = None) -> list[PeerResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="plain/empty cell pairs per tool and size")
    parser.add_argument("--budget-s", type=float, default=30.0, help="at most this long on one tool's pairs")
    parser.add_argument("--train-runs", type=int, default=5, help="training cells per tool (median)")
    parser.add_argument("--peers", default="", help="comma-separated tools to run besides fsdp2nb (default: all;"
                        " 'none': fsdp2nb alone)")
    parser.add_argument("--ranks", default="2,4", help="sizes for the empty cell and cold start")
    parser.add_argument("--markdown", help="write the table here (docs/peers.md)")
    parser.add_argument("--json", help="write the raw values here")
    parser.add_argument("--cell-timeout", type=float, default=180.0,
                        help="seconds a cell may take before it counts as failed (and is interrupted)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    global CELL_TIMEOUT_S
    CELL_TIMEOUT_S = args.cell_timeout
    wanted = {name for name in args.peers.split(",") if name}
    drivers = [d for d in DRIVERS if d.name == "fsdp2nb" or not wanted or d.name in wanted]
    sizes = [int(n) for n in args.ranks.split(",")]
    torchrun_start = {n: statistics.median(torchrun_cold_start_s(n) for _ in range(2)) for n in sizes}
    torchrun_steps_ms: list[float] = []
    results = []
    plain_kernel = Kernel(env=kernel_env())
    for _ in range(50):  # a new kernel's first cells are slower than its later ones
        checked_cell(plain_kernel, "pass")
    try:
        measure_all(drivers, sizes, args, results, torchrun_steps_ms, plain_kernel)
    finally:
        stop_kernel(plain_kernel)

    notes = ["torchrun of a script that imports torch and forms the group: "
             + ", ".join(f"{torchrun_start[n]:.2f} s on {n} ranks" for n in sizes)
             + "; the same 20 training steps inside torchrun: "
             + (f"{statistics.median(torchrun_steps_ms):.1f} ms a step (median of {len(torchrun_steps_ms)} runs)."
                if torchrun_steps_ms else "not run."),
             f"Machine: {os.cpu_count()} cores, torch {_torch_version()}, Python {sys.version.split()[0]}; "
             "ratios are to fsdp2nb (lower is better everywhere). The machine was shared with other work, and "
             "4 ranks on 2 cores means ranks wait for a core: read the 4-rank rows for order, not size."]
    table = markdown_table(results, notes)
    print("\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(MARKDOWN_HEAD + table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([r.__dict__ for r in results], handle, indent=1)
    return results


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
