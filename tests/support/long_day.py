"""A long session on one pool: thousands of mixed cells through a real kernel, with readings of
what the kernel and the ranks hold along the way.

The cells are what a day at a notebook is made of: empty and printing cells, training steps on a
tiny Llama that log with `fsdp2nb.log`, `%fsdp2 push` and `pull`, a cell where one rank raises,
tqdm loops, `%fsdp2 status`, checkpoint saves (keep=2) and, where the Checkpointer takes
`memory_every`, steps that snapshot the training state into memory. A reading (at the start,
after a warm-up, every few hundred cells and at the end) takes each process's resident memory,
open descriptors and threads from /proc, the pool's files on disk, /dev/shm, and an empty cell's
time. `unbounded_growth` names what grew between the warm-up and the end by more than a fixed
allowance; `make soak` runs 2,000 cells (tests/faults/test_long_day.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import statistics
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from fsdp2nb.host import rank_logs
from fsdp2nb.pool import pool_log
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

SETUP_CELL = """%%fsdp2
import inspect
import fsdp2nb
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
if rank == 0:
    save_tiny_checkpoint(model_dir, "llama")
dist.barrier()
model, tokenizer = fsdp2nb.load_model(model_dir, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
snapshots = "memory_every" in inspect.signature(fsdp2nb.Checkpointer).parameters
try:
    ckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=2, **({"memory_every": 1} if snapshots else {}))
except ValueError as refused:  # the keyword is there, the host memory behind it not (yet)
    snapshots = f"refused ({refused})"
    ckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=2)
ckpt.track(model=model, optimizer=optimizer)
step, loss = 0, float("nan")

def train_step():
    global step, loss
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
    output = model(input_ids=ids, labels=ids)
    output.loss.backward()
    fsdp2nb.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    loss = output.loss.item()
    fsdp2nb.log(step, loss=loss)
    step += 1

if rank == 0:
    print("snapshots in memory:", snapshots)
"""
"""The tiny Llama, its optimizer and a Checkpointer (with snapshots every step where they exist)."""

EMPTY_CELL = "%%fsdp2\npass"

CELLS = {
    "empty": EMPTY_CELL,
    "print": "%%fsdp2\nprint(f'cell {n} on rank {{rank}}')",
    "train": "%%fsdp2\ntrain_step()",
    "push": "payload = list(range({n}, {n} + 256))\n%fsdp2 push payload",
    "pull": "%fsdp2 pull loss step",
    "raise": "%%fsdp2\nif rank == 1:\n    raise ValueError('cell {n}: rank 1 raises on purpose')",
    "tqdm": "%%fsdp2\nfrom tqdm import tqdm\nfor _ in tqdm(range(40), mininterval=0):\n    pass",
    "status": "%fsdp2 status",
    "save": "%%fsdp2\ntrain_step()\nckpt.save(step)",
    "snapshot": "%%fsdp2\ntrain_step()\nckpt.maybe_save(step)",
}
"""Each kind of cell; `{n}` is the cell's number, so printing and pushing cells differ each time."""

MIX = {"empty": 5, "print": 3, "train": 4, "push": 1, "pull": 1, "raise": 1, "tqdm": 1, "status": 1,
       "save": 1, "snapshot": 2}
"""How many of each kind in every 20 cells, in a seeded order."""

FAILING_KINDS = frozenset({"raise"})

FD_ALLOWANCE = 4
"""Descriptors a process may hold more at the end than after the warm-up: a socket or pipe that
happens to be open at the moment of a reading (a save's writer, a gloo pair being made)."""
THREAD_ALLOWANCE = 2
"""Threads likewise: a save's worker or a partial-line flush caught at the moment of reading."""
FILE_ALLOWANCE = 2
"""Files in a directory likewise: a checkpoint being written beside the two kept, a log rotated."""
RSS_GROWTH_PER_1000_CELLS = 8 << 20
"""Resident memory a process may gain per 1,000 cells after the warm-up. A kernel without
fsdp2nb grows 1.5-1.6 MiB per 1,000 cells of this mix with IPython's own per-cell records
(docs/benchmarks.md, the long day), and malloc's arenas move by a few MiB on their own; anything
that kept one message, one snapshot or one traceback per cell (several KiB each) would pass
8 MiB within 1,000 cells."""

MIN_CELLS_TO_JUDGE_MEMORY = 1000
"""Fewer cells after the warm-up tell too little: the bounded histories (the dashboard's 2,000
metric points a rank, its 600 memory readings) are still filling, and malloc's noise is as large
as the growth allowed."""


@dataclass(frozen=True)
class ProcessReading:
    rss_bytes: int
    fds: int
    threads: int


@dataclass(frozen=True)
class DiskUsage:
    files: int
    bytes: int


@dataclass(frozen=True)
class Reading:
    """What the session held after `cells` mixed cells."""

    cells: int
    processes: dict[str, ProcessReading]
    """"kernel", "agent", "standby" and "rank N"."""
    disk: dict[str, DiskUsage]
    """"logs" (the pool's log directory), "runtime" (its socket and store directory), "state"
    (fsdp2nb's whole state directory) and "checkpoints"."""
    shm: DiskUsage
    """Every file under /dev/shm (other users' too: reported, not judged)."""
    shm_held: int
    """Entries of /dev/shm that the pool's processes hold open or mapped."""
    empty_cell_ms: float


@dataclass
class LongDayResult:
    num_ranks: int
    warmup_cells: int
    readings: list[Reading] = field(default_factory=list)
    kinds_run: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    """Cells that ended otherwise than they should (every cell succeeds but the raising one)."""
    snapshots: str = ""
    """Whether the Checkpointer took `memory_every` (snapshot cells then snapshot every step):
    "True", "False" (no such keyword) or why it was refused."""
    leftovers: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def baseline(self) -> Reading:
        """The reading after the warm-up: every kind of cell has run, caches and pools are filled."""
        return next(r for r in self.readings if r.cells >= self.warmup_cells)

    @property
    def end(self) -> Reading:
        return self.readings[-1]


class LongDay:
    """One kernel, one pool, `num_cells` mixed cells; `run()` returns a LongDayResult."""

    def __init__(self, *, num_cells: int, num_ranks: int = 2, seed: int = 0, warmup_cells: int = 100,
                 every: int = 500, workdir: str | None = None, cell_timeout_s: float = 120.0, log=print) -> None:
        self.num_cells, self.num_ranks = num_cells, num_ranks
        self.warmup_cells, self.every = min(warmup_cells, num_cells), every
        self.cell_timeout_s = cell_timeout_s
        self.log = log
        self.rng = random.Random(seed)
        self.root = Path(workdir or tempfile.mkdtemp(prefix="fsdp2nb-long-day-"))
        self.private_tmp = self.root / "tmp"  # the kernel's TMPDIR: fsdp2nb's state and runtime dirs land here
        self.marker = f"long-day-{uuid.uuid4().hex[:12]}"
        self.kernel: Kernel | None = None

    def run(self) -> LongDayResult:
        started = time.monotonic()
        result = LongDayResult(num_ranks=self.num_ranks, warmup_cells=self.warmup_cells)
        self.private_tmp.mkdir(parents=True, exist_ok=True)
        try:
            self._start(result)
            result.readings.append(self._reading(0))
            self.log(_reading_line(result.readings[-1]))
            for number, kind in enumerate(self._schedule(), 1):
                self._run_cell(number, kind, result)
                if number in self._reading_points():
                    result.readings.append(self._reading(number))
                    self.log(_reading_line(result.readings[-1]))
        finally:
            self._stop()
        result.leftovers = self._leftovers()
        result.wall_s = time.monotonic() - started
        return result

    # ---- cells ----------------------------------------------------------------------------------

    def _schedule(self) -> list[str]:
        block = [kind for kind, count in MIX.items() for _ in range(count)]
        schedule: list[str] = []
        while len(schedule) < self.num_cells:
            self.rng.shuffle(block)
            schedule.extend(block)
        return schedule[:self.num_cells]

    def _reading_points(self) -> set[int]:
        return {self.warmup_cells, *range(self.every, self.num_cells, self.every), self.num_cells}

    def _run_cell(self, number: int, kind: str, result: LongDayResult) -> None:
        run = self._kernel.execute(CELLS[kind].format(n=number), timeout=self.cell_timeout_s)
        result.kinds_run[kind] += 1
        expected = "error" if kind in FAILING_KINDS else "ok"
        if run.status != expected:
            text = (run.traceback_text or run.stderr)[-600:]
            result.failures.append(f"cell {number} ({kind}): {run.status}, expected {expected}: {text}")

    def _start(self, result: LongDayResult) -> None:
        env = {**WITHOUT_GPUS, "TMPDIR": str(self.private_tmp), "FSDP2NB_SOAK_MARKER": self.marker}
        self.kernel = Kernel(env=env)
        for code in ("%load_ext fsdp2nb", f"%fsdp2 start --cpu {self.num_ranks}",
                     f"model_dir = {str(self.root / 'model')!r}\nckpt_dir = {str(self.root / 'ckpt')!r}\n"
                     "%fsdp2 push model_dir ckpt_dir", FACTS_FUNCTION, SETUP_CELL):
            run = self.kernel.execute(code, timeout=300)
            if run.status != "ok":
                raise RuntimeError(f"setting up failed at {code[:40]!r}: {run.traceback_text[-2000:]}")
        said = re.search(r"snapshots in memory: (.*)", run.stdout)  # the set-up cell's, run last
        result.snapshots = said.group(1).strip() if said else "?"

    def _stop(self) -> None:
        if self.kernel is None:
            return
        with contextlib.suppress(Exception):
            self.kernel.execute("%%fsdp2\nckpt.wait()", timeout=self.cell_timeout_s)
        with contextlib.suppress(Exception):
            self.kernel.execute("%fsdp2 stop", timeout=60)
        with contextlib.suppress(Exception):
            self.kernel.stop()
        self.kernel = None

    @property
    def _kernel(self) -> Kernel:
        assert self.kernel is not None, "the kernel runs from _start to _stop"
        return self.kernel

    # ---- readings -----------------------------------------------------------------------------

    def _reading(self, cells: int) -> Reading:
        self._settle()
        facts = self._pool_facts()
        processes = self._processes(facts)
        return Reading(cells=cells, processes={name: _process_reading(pid) for name, pid in processes.items()},
                       disk=self._disk(facts), shm=_usage(Path("/dev/shm")),
                       shm_held=len(_shm_held(processes.values())), empty_cell_ms=self._empty_cell_ms())

    def _settle(self) -> None:
        """Let an async save in flight commit: a reading then sees the two checkpoints kept, not
        a third on its way (and the retention that follows its commit)."""
        run = self._kernel.execute("%%fsdp2\nckpt.wait()", timeout=self.cell_timeout_s)
        if run.status != "ok":
            raise RuntimeError(f"the save in flight failed: {run.traceback_text[-1000:]}")

    def _pool_facts(self) -> dict:
        run = self._kernel.execute("_long_day_facts()", timeout=30)
        if run.status != "ok":
            raise RuntimeError(f"the pool's facts could not be read: {run.traceback_text[-1000:]}")
        return json.loads(run.stdout)

    def _processes(self, facts: dict) -> dict[str, int]:
        kernel = psutil.Process(self._kernel.pid)
        ranks = {int(rank): pid for rank, pid in facts["ranks"].items()}
        agents = [child for child in kernel.children() if "fsdp2nb.worker.agent" in " ".join(_cmdline(child))]
        rank_parents = {_parent_pid(pid) for pid in ranks.values()}
        processes = {"kernel": kernel.pid}
        for agent in agents:
            processes["agent" if agent.pid in rank_parents else "standby"] = agent.pid
        processes.update({f"rank {rank}": pid for rank, pid in sorted(ranks.items())})
        return processes

    def _disk(self, facts: dict) -> dict[str, DiskUsage]:
        state = self.private_tmp / f"fsdp2nb-{os.getuid()}"
        runtime = [path for path in self.private_tmp.glob("fsdp2nb-*") if path != state]
        return {"logs": _usage(Path(facts["log_dir"])),
                "runtime": _sum_usage([_usage(path) for path in runtime]),
                "state": _usage(state), "checkpoints": _usage(self.root / "ckpt")}

    def _empty_cell_ms(self, runs: int = 20) -> float:
        times = []
        for _ in range(runs):
            began = time.perf_counter()
            run = self._kernel.execute(EMPTY_CELL, timeout=self.cell_timeout_s)
            times.append((time.perf_counter() - began) * 1e3)
            if run.status != "ok":
                raise RuntimeError(f"an empty cell failed: {run.traceback_text[-1000:]}")
        return statistics.median(times)

    def _leftovers(self) -> list[str]:
        """The session's processes that outlived its kernel, ended here and named."""
        found = []
        deadline = time.monotonic() + 10
        while (alive := _processes_marked(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for process in alive:
            found.append(f"process {process.pid} {' '.join(_cmdline(process))[:80]}")
            with contextlib.suppress(psutil.Error):
                process.kill()
        return found


FACTS_FUNCTION = """def _long_day_facts():
    import json
    import fsdp2nb
    pool = fsdp2nb._session.pool
    print(json.dumps({"log_dir": pool.log_dir, "ranks": {rank: info.pid for rank, info in pool.ranks.items()}}))
"""
"""Defined once in the kernel: what a reading needs from the pool (its log directory, its ranks)."""


# ---- judging --------------------------------------------------------------------------------------


def unbounded_growth(result: LongDayResult) -> list[str]:
    """What grew between the warm-up and the end by more than its allowance, one line each
    (resident memory only after `MIN_CELLS_TO_JUDGE_MEMORY` cells past the warm-up)."""
    start, end = result.baseline, result.end
    num_cells = end.cells - start.cells
    problems = []
    for name, last in end.processes.items():
        first = start.processes.get(name)
        if first is None:
            problems.append(f"{name}: a process that was not there after the warm-up")
            continue
        if last.fds > first.fds + FD_ALLOWANCE:
            problems.append(f"{name}: open descriptors {first.fds} -> {last.fds}")
        if last.threads > first.threads + THREAD_ALLOWANCE:
            problems.append(f"{name}: threads {first.threads} -> {last.threads}")
        per_1000 = _per_1000(last.rss_bytes - first.rss_bytes, num_cells)
        if num_cells >= MIN_CELLS_TO_JUDGE_MEMORY and per_1000 > RSS_GROWTH_PER_1000_CELLS:
            problems.append(f"{name}: resident memory grew {per_1000 / 2**20:.1f} MiB per 1,000 cells "
                            f"({_mib(first.rss_bytes)} -> {_mib(last.rss_bytes)})")
    for name, last in end.disk.items():
        if last.files > start.disk[name].files + FILE_ALLOWANCE:
            problems.append(f"{name}: files {start.disk[name].files} -> {last.files}")
    log_cap = log_bytes_cap(result.num_ranks)
    if end.disk["logs"].bytes > log_cap:
        problems.append(f"logs: {end.disk['logs'].bytes} bytes, above the rotation's cap of {log_cap}")
    if end.shm_held > start.shm_held:
        problems.append(f"/dev/shm entries held by the pool: {start.shm_held} -> {end.shm_held}")
    return problems


def log_bytes_cap(num_ranks: int) -> int:
    """The most the pool's log directory may hold: each rank's log and pool.log with one rotated
    file each, and the agent's log (which holds a few lines per rank's start and exit)."""
    return 2 * (num_ranks * getattr(rank_logs, "RANK_LOG_MAX_BYTES", 1 << 40)
                + getattr(pool_log, "POOL_LOG_MAX_BYTES", 1 << 40)) + (1 << 20)


def _per_1000(growth: int, num_cells: int) -> float:
    return growth * 1000 / num_cells if num_cells > 0 else 0.0


# ---- the table ------------------------------------------------------------------------------------


def summary_table(result: LongDayResult) -> str:
    """Every reading side by side, with the growth per 1,000 cells after the warm-up."""
    readings, start, end = result.readings, result.baseline, result.end
    header = ["", *(f"cell {r.cells}" for r in readings), "/1000 cells"]
    rows = [header]

    def row(label: str, values: list[float], text) -> None:
        growth = _per_1000(values[readings.index(end)] - values[readings.index(start)], end.cells - start.cells)
        rows.append([label, *(text(v) for v in values), text(growth)])

    for name in end.processes:
        present = [r.processes.get(name) for r in readings]
        row(f"{name} RSS MiB", [p.rss_bytes / 2**20 if p else 0.0 for p in present], lambda v: f"{v:.1f}")
        row(f"{name} fds", [p.fds if p else 0 for p in present], lambda v: f"{v:g}")
        row(f"{name} threads", [p.threads if p else 0 for p in present], lambda v: f"{v:g}")
    for name in end.disk:
        row(f"{name} files", [r.disk[name].files for r in readings], lambda v: f"{v:g}")
        row(f"{name} KiB", [r.disk[name].bytes / 1024 for r in readings], lambda v: f"{v:.0f}")
    row("/dev/shm files", [r.shm.files for r in readings], lambda v: f"{v:g}")
    row("/dev/shm held by pool", [r.shm_held for r in readings], lambda v: f"{v:g}")
    row("empty cell ms (median 20)", [r.empty_cell_ms for r in readings], lambda v: f"{v:.1f}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width)
                       in enumerate(zip(r, widths, strict=True))) for r in rows]
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(result.kinds_run.items()))
    footer = (f"{end.cells} cells on {result.num_ranks} CPU ranks in {result.wall_s:.0f} s ({kinds}); "
              f"snapshots in memory every step: {result.snapshots}; "
              f"growth per 1,000 cells from cell {start.cells} to cell {end.cells}")
    return "\n".join([*lines, footer])


def _reading_line(reading: Reading) -> str:
    ranks = [p for name, p in reading.processes.items() if name.startswith("rank")]
    kernel = reading.processes["kernel"]
    return (f"cell {reading.cells}: kernel {_mib(kernel.rss_bytes)} {kernel.fds} fds {kernel.threads} threads; "
            f"ranks {' '.join(_mib(p.rss_bytes) for p in ranks)}; logs {reading.disk['logs'].bytes} B; "
            f"empty cell {reading.empty_cell_ms:.1f} ms")


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


# ---- /proc and the disk ---------------------------------------------------------------------------


def _process_reading(pid: int) -> ProcessReading:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss_kib = int(status["VmRSS"].split()[0])
    return ProcessReading(rss_bytes=rss_kib * 1024, fds=len(os.listdir(f"/proc/{pid}/fd")),
                          threads=int(status["Threads"]))


def _shm_held(pids) -> set[str]:
    """/dev/shm entries that these processes hold open or have mapped."""
    held: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        held.add(target.split(" (deleted)")[0])
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
                if path.startswith("/dev/shm/"):
                    held.add(path.split(" (deleted)")[0])
    return held


def _usage(path: Path) -> DiskUsage:
    files = total = 0
    with contextlib.suppress(OSError):
        for entry in path.rglob("*"):
            with contextlib.suppress(OSError):
                info = entry.lstat()
                if not entry.is_dir():
                    files += 1
                    total += info.st_size
    return DiskUsage(files=files, bytes=total)


def _sum_usage(usages: list[DiskUsage]) -> DiskUsage:
    return DiskUsage(files=sum(u.files for u in usages), bytes=sum(u.bytes for u in usages))


def _parent_pid(pid: int) -> int:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).ppid()
    return 0


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


def _processes_marked(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get("FSDP2NB_SOAK_MARKER") == marker:
                found.append(process)
    return found
