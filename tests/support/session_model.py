"""A seeded model-checker of whole notebook sessions (issue 58).

`SessionMachine` is a Hypothesis `RuleBasedStateMachine`: each example starts a real kernel with a
2-rank CPU pool and drives it, cell by cell, through what users do (training steps; async, waited
and synchronous saves; loads of LATEST, of an older step and of memory; snapshots on and off; a
rank raising inside a collective; the stop button while ranks wait in one; a rank SIGKILLed inside a
cell and between cells; the host agent killed; `%fsdp2 restart`; a loop rewound to step 0; a
background run; detach and attach of a kept pool). Hypothesis picks the actions from its seed and
shrinks a failing sequence to a short one: `check_seeds` reports the first failing sequence and the
shortest one that failed.

`Session` keeps the reference of what the state must be. Every training step is seeded by its step
number, so the state after a sequence of steps is a pure function of that sequence: the lineage is
a tree whose nodes are "this step applied to that node", and every rank prints the digest of its
own shards (model and optimizer) after each step, load and set-up. A node's digest is recorded the
first time it is seen; reaching the node again (by training the same path in another pool, or by a
restore) must give the same digest on every rank. After every action the invariants hold:

- a save that a cell reported as done is committed and loads bitwise to its node's digest;
- a save that failed is said so in the cell that asked for it or the very next one, and LATEST never
  names a step older (in write order) than the last save reported as done;
- a restore (disk or memory) gives exactly the digest of the node it restores, never one of an
  abandoned run;
- no cell runs past its timeout;
- no rank holds more threads or open file descriptors than after its set-up, beyond what comes and
  goes (tests/support/rank_resources.py), read from /proc after every action and at the end;
- at the end no process, private directory, socket or snapshot file of the session is left over.

Actions that hit a defect still open are listed in `KNOWN_DEFECTS` (the action, the invariant it
breaks, the seed that shows it); the harness steers around them unless the entry's name is listed
in the environment variable FSDP2NB_SESSION_DEFECTS (or "all").
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from hypothesis import HealthCheck, Phase, assume, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from fsdp2nb.checkpoint import layout
from tests.support.kernel_client import WITHOUT_GPUS, CellRun, Kernel
from tests.support.rank_resources import Holdings, read_holdings, settled_growth

WIDTH, KEEP = 32, 3
"""The MLP's width (two hidden blocks, each sharded) and the checkpoints kept on disk."""
CELL_TIMEOUT_S = 120.0
"""No cell may run longer: a collective left waiting times out well before (the pool's timeout)."""
COLLECTIVE_TIMEOUT_S = 15.0
"""The pool's collective timeout: above its interrupt delay and restart grace (see test_fault_campaign)."""
KILL_PACE_S = 0.3
"""Seconds a step sleeps in the cell whose rank is killed, so that the kill lands inside the loop."""


@dataclass(frozen=True)
class KnownDefect:
    """An action that breaks an invariant on this tree, and the seed that shows it."""

    action: str
    invariant: str
    seed: int
    run: str
    """Which run of that seed: "short" (`--session-seed SEED`, the suite's test), or the soak's
    options that reproduce it."""


KNOWN_DEFECTS: dict[str, KnownDefect] = {}
"""Defects the checker finds that are not fixed yet, by name; the harness steers around each one
(see `Session.steers_around`). Remove an entry once its fix is in, and the action joins the runs.
Empty: the three it found (a save before the first step, a rewind with snapshots, snapshots
turned off) are fixed, and seeds 3, 5 and 6 pass with every action."""


class InvariantBroken(AssertionError):
    """What the session did differs from what the reference says it must."""


# ---- the notebook ------------------------------------------------------------------------------

SETUP_CELL = """%%fsdp2
import hashlib, os, time
import fsdp2nb
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear({width}, {width}), nn.Tanh(), nn.Linear({width}, {width}), nn.Tanh(),
                      nn.Linear({width}, 1))
fully_shard(model[0])
fully_shard(model[2])
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = fsdp2nb.Checkpointer({ckpt_dir!r}, keep={keep}, memory_every={memory_every}).track(
    model=model, optimizer=optimizer)

def train_step(step, pace_s=0.0):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # the data depend on the step only
    x = torch.randn(8, {width}, generator=generator)                 # [batch, width]
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).tanh())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(pace_s)

def _hash_into(digest, value):
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _hash_into(digest, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _hash_into(digest, item)
    elif isinstance(value, torch.Tensor):
        local = value.to_local() if isinstance(value, DTensor) else value
        digest.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    else:
        digest.update(repr(value).encode())

reported_lines = []  # a background run's reports, printed again once it has ended

def report(step):
    digest = hashlib.sha256()
    _hash_into(digest, model.state_dict())
    _hash_into(digest, optimizer.state_dict())
    line = f"@@state {{rank}} {{-1 if step is None else step}} {{digest.hexdigest()[:16]}} {{os.getpid()}}"
    reported_lines.append(line)
    print(line, flush=True)

report(ckpt.last_step)
"""

SAVE_LINES = {
    "async": "ckpt.save(step)",
    "async_wait": "ckpt.save(step)\n        ckpt.wait()",
    "sync": "ckpt.async_save = False\n        try:\n            ckpt.save(step)\n"
            "        finally:\n            ckpt.async_save = True",
}
"""How a training cell saves at its chosen step: async (the default), async then wait, synchronous."""

TRAIN_CELL = """%%fsdp2{line}
reported_lines.clear()
for step in range({first}, {end}):
    train_step(step, {pace_s})
    report(step)
    ckpt.maybe_save(step)
    if step == {save_at}:
        {save}
        if rank == 0:
            print(f"@@saved {{step}}", flush=True)
"""

SAVE_CELL = """%%fsdp2
step = {step}
{save}
if rank == 0:
    print(f"@@saved {{step}}", flush=True)
report(step)
"""
"""A save of the live state at the step the checker follows (a new checkpointer's `last_step` is
None); it reports the state after, which the save must not have changed."""

REPORTED_CELL = """%%fsdp2
print(*reported_lines, sep="\\n", flush=True)
"""
"""What a background run reported, printed again after `%fsdp2 wait`."""

WAIT_CELL = """%%fsdp2
ckpt.wait()
if rank == 0:
    print("@@waited", flush=True)
"""

LOAD_CELL = """%%fsdp2
report(ckpt.load({target!r}))
"""

REPORT_CELL = """%%fsdp2
report(ckpt.last_step)
"""

RETRACK_CELL = """%%fsdp2
ckpt.close()
ckpt = fsdp2nb.Checkpointer({ckpt_dir!r}, keep={keep}, memory_every={memory_every}).track(
    model=model, optimizer=optimizer)
report(ckpt.last_step)
"""

RAISE_CELL = """%%fsdp2
if rank == 1:
    raise RuntimeError("injected fault while rank 0 waits in a collective")
dist.all_reduce(torch.ones(1))
"""

WAITING_CELL = """%%fsdp2
if rank == 1:
    print("@@waiting", flush=True)
    time.sleep(60)
dist.all_reduce(torch.ones(1))
"""

PROBE_CELL = """%%fsdp2
probe = torch.ones(1)
dist.all_reduce(probe)
print(f"@@probe {int(probe.item())} {os.getpid()}", flush=True)
"""

SAVE_FAILED = re.compile(r"save of step (\d+) failed|an earlier background save failed")
RESTART_ADVICE = "`%fsdp2 restart` starts a fresh"
STATE_LINE = re.compile(r"@@state (\d+) (-?\d+) ([0-9a-f]+) (\d+)")


# ---- the reference ------------------------------------------------------------------------------

@dataclass
class Node:
    """The state after `step` was applied to `parent` (the root: the seeded initial state)."""

    id: int
    parent: int | None
    step: int | None
    digests: dict[int, str] = field(default_factory=dict)
    """Each rank's digest, as first seen."""


class Lineage:
    """The tree of states the session reached; a node is a pure function of its path."""

    def __init__(self) -> None:
        self.nodes = [Node(0, None, None)]
        self._children: dict[tuple[int, int], int] = {}

    def child(self, parent: int, step: int) -> int:
        key = (parent, step)
        if key not in self._children:
            self._children[key] = len(self.nodes)
            self.nodes.append(Node(len(self.nodes), parent, step))
        return self._children[key]

    def ancestors(self, node: int) -> list[int]:
        """`node` and every node above it, nearest first."""
        chain: list[int] = []
        current: int | None = node
        while current is not None:
            chain.append(current)
            current = self.nodes[current].parent
        return chain

    def matches(self, node: int, seen: dict[int, str]) -> bool:
        known = self.nodes[node].digests
        return all(known.get(rank, digest) == digest for rank, digest in seen.items())

    def observe(self, node: int, seen: dict[int, str], what: str) -> None:
        """Record `seen` as the node's digests, or check it against those recorded."""
        if not self.matches(node, seen):
            raise InvariantBroken(f"{what}: digests {seen} differ from {self.nodes[node].digests} recorded for "
                                  f"{self.describe(node)}")
        self.nodes[node].digests.update(seen)

    def describe(self, node: int) -> str:
        steps = [self.nodes[n].step for n in reversed(self.ancestors(node))][1:]
        shown = steps if len(steps) <= 12 else [*steps[:4], "...", *steps[-6:]]
        return f"node {node} (steps {shown})"


@dataclass
class SavedStep:
    """A save asked for: the node it saves, the cell that asked, and what became of it."""

    step: int
    node: int
    cell: int
    outcome: str = "pending"  # pending, done, failed, unknown (a process died before it was said)


@dataclass(frozen=True)
class Violation:
    """An invariant broken: the seed, every action of the session up to it, and what broke."""

    seed: int
    actions: tuple[str, ...]
    error: str

    def __str__(self) -> str:
        return f"seed {self.seed}, after {len(self.actions)} actions ({' / '.join(self.actions)}): {self.error}"


@dataclass
class Tally:
    """What the runs did, summed over examples and seeds."""

    actions: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    saves: Counter = field(default_factory=Counter)
    restores: Counter = field(default_factory=Counter)
    steered: Counter = field(default_factory=Counter)
    """Actions skipped, by the known defect they would have met."""
    cells: int = 0
    sessions: int = 0
    violations: list[Violation] = field(default_factory=list)
    """Each invariant broken, shrinking's tries included."""
    wall_s: float = 0.0

    def table(self) -> str:
        def row(counter: Counter) -> str:
            return ", ".join(f"{name} {count}" for name, count in sorted(counter.items())) or "none"

        return "\n".join([
            f"sessions {self.sessions}, actions {sum(self.actions.values())}, cells {self.cells}, "
            f"time {self.wall_s:.0f} s",
            f"actions: {row(self.actions)}",
            f"faults injected: {row(self.faults)} (total {sum(self.faults.values())})",
            f"saves: {row(self.saves)}",
            f"restores: {row(self.restores)}",
            f"actions skipped for a known defect: {row(self.steered)}",
        ])


def enabled_defects() -> set[str]:
    """The known defects to run into rather than steer around (FSDP2NB_SESSION_DEFECTS)."""
    names = {name.strip() for name in os.environ.get("FSDP2NB_SESSION_DEFECTS", "").split(",") if name.strip()}
    return set(KNOWN_DEFECTS) if "all" in names else names


# ---- the session --------------------------------------------------------------------------------

class Session:
    """One kernel and its pool, driven as a user would, checked against the lineage after each cell."""

    def __init__(self, tally: Tally, *, kept: bool, log=print, start: bool = True) -> None:
        """`start=False`: no kernel, for checking the checker itself."""
        self.tally, self.kept, self.log = tally, kept, log
        self.root = Path(tempfile.mkdtemp(prefix="fsdp2nb-session-"))
        self.ckpt_dir = self.root / "ckpt"
        self.private_tmp = self.root / "tmp"
        self.marker = f"session-{uuid.uuid4().hex[:12]}"
        self.snapshot_dir = Path("/dev/shm" if os.path.isdir("/dev/shm") else self.root) / f"fsdp2nb-{self.marker}"
        for path in (self.ckpt_dir, self.private_tmp, self.snapshot_dir):
            path.mkdir(mode=0o700)
        self.pool_name = self.marker
        self.lineage = Lineage()
        self.current = 0
        self.snapshots_on = True
        self.snapshots: list[int] = []
        """Nodes snapshotted into host memory, in write order (the newest last)."""
        self.snapshotted_any = False
        """Whether this kernel's store ever held a snapshot (a disk load does not empty it)."""
        self.saves: list[SavedStep] = []
        self.num_cells = 0
        self.rank_pids: dict[int, int] = {}
        self.baselines: dict[int, Holdings] = {}
        """Each rank's threads and descriptors once set up; taken again for fresh ranks."""
        self.background_runs = 0
        self.done: list[str] = []
        """The actions so far, as the log shows them."""
        self.kernel: Kernel | None = None
        self.steers_around = set(KNOWN_DEFECTS) - enabled_defects()
        if start:
            try:
                self._start()
            except BaseException:  # the machine never sees this session: end it here
                self.close()
                raise

    # ---- cells ----------------------------------------------------------------------------------

    def steer(self, defect: str) -> None:
        """Skip an action that would meet the known defect `defect`."""
        self.tally.steered[defect] += 1
        self.note(f"(steered around: {defect})")

    def note(self, action: str) -> None:
        self.done.append(action)
        self.log(f"  cell {self.num_cells:4d}: {action}")

    def execute(self, code: str, *, timeout: float = CELL_TIMEOUT_S) -> CellRun:
        """Run one cell; a cell past its timeout breaks an invariant. Every cell's saves are checked."""
        assert self.kernel is not None
        self.num_cells += 1
        self.tally.cells += 1
        try:
            run = self.kernel.execute(code, timeout=timeout)
        except TimeoutError as error:
            raise InvariantBroken(f"cell {self.num_cells} ran past its timeout of {timeout:.0f} s: "
                                  f"{code.splitlines()[1:3]}") from error
        self._note_save_failures(run)
        return run

    def _said(self, run: CellRun) -> str:
        return run.stdout + run.stderr + run.traceback_text

    def _states(self, run: CellRun) -> list[tuple[int, dict[int, str]]]:
        """The (step, {rank: digest}) pairs a cell reported, in step order of first appearance."""
        by_step: dict[int, dict[int, str]] = {}
        for match in STATE_LINE.finditer(run.stdout):
            rank, step, digest, pid = int(match[1]), int(match[2]), match[3], int(match[4])
            by_step.setdefault(step, {})[rank] = digest
            self.rank_pids[rank] = pid
        return list(by_step.items())

    def _one_state(self, run: CellRun, what: str) -> tuple[int | None, dict[int, str]]:
        states = self._states(run)
        if run.status != "ok" or len(states) != 1:
            raise InvariantBroken(f"{what}: the cell failed or reported no state: {self._last_lines(run)}")
        step, seen = states[0]
        return (None if step < 0 else step), seen

    @staticmethod
    def _last_lines(run: CellRun) -> str:
        text = [line for line in (run.traceback_text or run.stderr or run.stdout).strip().splitlines() if line.strip()]
        return " | ".join(text[-4:])[:800]

    # ---- saves and the disk ---------------------------------------------------------------------

    def _ask_save(self, step: int, mode: str, cell: int | None = None) -> SavedStep:
        """A save asked for in `cell` (default: the cell that ran last)."""
        save = SavedStep(step=step, node=self.current, cell=self.num_cells if cell is None else cell)
        self.saves.append(save)
        self.tally.saves[f"asked {mode}"] += 1
        return save

    def _note_save_failures(self, run: CellRun) -> None:
        """A cell that says a save failed: the saves still pending failed (a failed save is said in
        the cell that asked or the very next one)."""
        said = self._said(run)
        if not SAVE_FAILED.search(said):
            return
        named = {int(step) for step in re.findall(r"save of step (\d+) failed", said)}
        for save in self.saves:
            if save.outcome != "pending" or (named and save.step not in named and save.cell < self.num_cells):
                continue
            save.outcome = "failed"
            self.tally.saves["failed"] += 1
            if self.num_cells > save.cell + 1:
                raise InvariantBroken(f"the save of step {save.step} asked in cell {save.cell} was said to have "
                                      f"failed only in cell {self.num_cells}: {self._last_lines(run)}")

    def _saves_done(self) -> None:
        """A cell that waited on the checkpointer and ended well: every pending save is committed."""
        for save in self.saves:
            if save.outcome == "pending":
                save.outcome = "done"
                self.tally.saves["done"] += 1
        self.check_disk()

    def _saves_unknown(self) -> None:
        """Processes died: whether the pending saves committed was never said."""
        for save in self.saves:
            if save.outcome == "pending":
                save.outcome = "unknown"
                self.tally.saves["unknown (a process died)"] += 1

    def _last_done(self) -> SavedStep | None:
        done = [save for save in self.saves if save.outcome == "done"]
        return done[-1] if done else None

    def check_disk(self) -> None:
        """The last save reported done is committed, and LATEST names it or a save asked after it."""
        last = self._last_done()
        if last is None:
            return
        index = self.saves.index(last)
        later = {save.step for save in self.saves[index + 1:] if save.outcome != "failed"}
        latest = layout.read_latest(self.ckpt_dir)
        if latest != last.step and latest not in later:
            raise InvariantBroken(f"LATEST names step {latest}, but the last save reported done was step {last.step} "
                                  f"(later saves asked: {sorted(later)})")
        step_dir = self.ckpt_dir / layout.step_dir_name(last.step)
        if latest == last.step and not layout.is_complete(step_dir, layout.read_metadata(step_dir)):
            raise InvariantBroken(f"the save of step {last.step} was reported done, but {step_dir.name} is not "
                                  "a complete checkpoint")

    def disk_candidates(self, step: int) -> list[int]:
        """The nodes a load of `step` may give: the newest save of that step reported done, and
        any saved after it whose outcome was never said."""
        candidates: list[int] = []
        for save in self.saves:
            if save.step != step or save.outcome == "failed" or save.outcome == "pending":
                continue
            if save.outcome == "done":
                candidates = [save.node]
            else:
                candidates.append(save.node)
        return candidates

    def loadable_steps(self) -> list[int]:
        """Steps saved and committed on disk now (retention may have removed older ones)."""
        steps = sorted({save.step for save in self.saves if save.outcome == "done"})
        return [step for step in steps
                if layout.is_complete(self.ckpt_dir / layout.step_dir_name(step),
                                      layout.read_metadata(self.ckpt_dir / layout.step_dir_name(step)))]

    # ---- the pool -------------------------------------------------------------------------------

    def _start(self) -> None:
        env = {**WITHOUT_GPUS, "TMPDIR": str(self.private_tmp), "FSDP2NB_SOAK_MARKER": self.marker,
               "FSDP2NB_SHARED_MEMORY_DIR": str(self.snapshot_dir)}
        self.kernel = Kernel(env=env)
        self.tally.sessions += 1
        run = self.execute("%load_ext fsdp2nb")
        assert run.status == "ok", run.traceback_text
        keep = f" --keep --name {self.pool_name} --keep-for 30m" if self.kept else ""
        run = self.execute(f"%fsdp2 start --cpu 2 --timeout {COLLECTIVE_TIMEOUT_S:g} --no-dashboard{keep}")
        if run.status != "ok":
            raise InvariantBroken(f"the pool did not start: {self._last_lines(run)}")
        self.setup("start")

    def setup(self, why: str) -> None:
        """Build the model, optimizer and checkpointer on fresh ranks; `track()` may restore a snapshot."""
        run = self.execute(SETUP_CELL.format(width=WIDTH, ckpt_dir=str(self.ckpt_dir), keep=KEEP,
                                             memory_every=1 if self.snapshots_on else None))
        step, seen = self._one_state(run, f"the set-up after {why}")
        self._take_baselines()
        if step is None:
            self.current = 0
            self.lineage.observe(0, seen, f"the set-up after {why} (nothing restored)")
            return
        self.tally.restores["memory (set-up)"] += 1
        self._restored_from_memory(step, seen, f"the set-up after {why} restored step {step}")

    def _take_baselines(self) -> None:
        for rank, pid in self.rank_pids.items():
            holdings = read_holdings(pid)
            if holdings is not None:
                self.baselines[rank] = holdings

    def check_resources(self) -> None:
        """No rank holds more threads or descriptors than its baseline allows; ranks replaced
        without a set-up since are left to the other invariants."""
        for rank, pid in sorted(self.rank_pids.items()):
            baseline = self.baselines.get(rank)
            if baseline is None or baseline.pid != pid:
                continue
            now, exceeded = settled_growth(baseline, snapshot_dir=self.snapshot_dir, ckpt_dir=self.ckpt_dir)
            if now is not None and exceeded:
                raise InvariantBroken(f"rank {rank} (pid {pid}) grew: {'; '.join(exceeded)}. After its set-up it held "
                                      f"{baseline.describe()}; now {now.describe()}")

    def _restored_from_memory(self, step: int, seen: dict[int, str], what: str) -> None:
        """A snapshot restored: it must be one written by the current run, of that step, and whole."""
        allowed = self.memory_candidates()
        for node in allowed:
            if self.lineage.nodes[node].step == step and self.lineage.matches(node, seen):
                self.lineage.observe(node, seen, what)
                self.current = node
                return
        others = [n.id for n in self.lineage.nodes if n.step == step and n.digests and
                  self.lineage.matches(n.id, seen)]
        if not others:
            where = "it matches no state the session reached"
        elif others[0] in self.lineage.ancestors(self.current):
            where = f"it is {self.lineage.describe(others[0])}, older in write order than the newest snapshot"
        else:
            where = f"it is {self.lineage.describe(others[0])}, of an abandoned run"
        raise InvariantBroken(f"{what}: {where}; the snapshots it may restore: "
                              f"{[self.lineage.describe(n) for n in allowed]}")

    def memory_candidates(self) -> list[int]:
        """What a restore from memory may give: the newest snapshot written, or the one before it
        when the newest copy may have been cut short; both on the current run's path."""
        if not self.snapshots:
            return []
        newest = self.snapshots[-1]
        path = set(self.lineage.ancestors(newest))
        return [node for node in self.snapshots[-2:] if node in path]

    def _pool_lost(self, why: str) -> None:
        """The ranks were replaced: pending saves' outcomes are unknown; set the notebook up again."""
        self._saves_unknown()
        self.setup(why)

    def _same_ranks_after(self, before: dict[int, int], what: str, fault: CellRun) -> None:
        run = self.execute(REPORT_CELL)
        if run.status != "ok":
            raise InvariantBroken(f"{what}: the state was lost; the cell of the fault said: {self._last_lines(fault)}; "
                                  f"the next: {self._last_lines(run)}")
        step, seen = self._one_state(run, what)
        if self.rank_pids != before:
            raise InvariantBroken(f"{what}: every process stayed alive, yet the ranks were replaced "
                                  f"({before} -> {self.rank_pids}) and their state lost")
        self.lineage.observe(self.current, seen, f"{what}: the state after")

    def _agent(self) -> psutil.Process | None:
        with contextlib.suppress(psutil.Error, KeyError):
            return psutil.Process(psutil.Process(self.rank_pids[0]).ppid())
        return None

    # ---- actions ---------------------------------------------------------------------------------

    def train(self, num_steps: int, save_mode: str, *, first: int | None = None, pace_s: float = 0.0,
              background: bool = False) -> CellRun:
        if first is None:
            last = self.lineage.nodes[self.current].step
            first = 0 if last is None else last + 1
        end = first + num_steps
        save_at = end - 1 if save_mode != "none" else -1
        line = f" --bg --name run{self.background_runs}" if background else ""
        code = TRAIN_CELL.format(line=line, first=first, end=end, pace_s=pace_s, save_at=save_at,
                                 save=SAVE_LINES.get(save_mode, "pass"))
        if background:
            self.background_runs += 1
            run = self.execute(code)
            if run.status != "ok":
                raise InvariantBroken(f"a background run did not start: {self._last_lines(run)}")
            run = self.execute(f"%fsdp2 wait run{self.background_runs - 1}")
            if run.status == "ok":
                run = self.execute(REPORTED_CELL)
        else:
            run = self.execute(code)
        self._advance(run, first, end if run.status == "ok" else None)
        if save_at >= 0 and "@@saved" in run.stdout or (run.status != "ok" and f"save of step {save_at} failed"
                                                          in self._said(run)):
            save = self._ask_save(save_at, save_mode)
            save.node = self.current
            if f"save of step {save_at} failed" in self._said(run):
                save.outcome = "failed"
                self.tally.saves["failed"] += 1
            elif save_mode in ("async_wait", "sync"):
                self._saves_done()
        if run.status != "ok" or background:
            self._check_current(f"after {'a background run' if background else 'a training cell that failed'}")
        self.check_disk()
        return run

    def _advance(self, run: CellRun, first: int, end: int | None) -> None:
        """Follow the steps a training cell reported (to `end` when it ended well)."""
        reported = dict(self._states(run))
        last = max(reported, default=first - 1) + 1 if end is None else end
        for step in range(first, last):
            self.current = self.lineage.child(self.current, step)
            if step in reported:
                self.lineage.observe(self.current, reported[step], f"training step {step}")
            if self.snapshots_on:
                self.snapshots.append(self.current)
                self.snapshotted_any = True

    def _check_current(self, what: str) -> None:
        run = self.execute(REPORT_CELL)
        _, seen = self._one_state(run, what)
        self.lineage.observe(self.current, seen, what)

    def save_now(self, mode: str) -> None:
        step = self.lineage.nodes[self.current].step
        save = self._ask_save(0 if step is None else step, mode, cell=self.num_cells + 1)
        run = self.execute(SAVE_CELL.format(step=save.step, save=SAVE_LINES[mode].replace("\n        ", "\n")))
        if run.status != "ok":
            if save.outcome == "pending":
                save.outcome = "failed"
                self.tally.saves["failed"] += 1
            return
        _, seen = self._one_state(run, f"a save ({mode})")
        if not self.lineage.matches(self.current, seen):
            raise InvariantBroken(f"a save ({mode}) of step {save.step} changed the live state: digests {seen}, "
                                  f"{self.lineage.describe(self.current)} had {self.lineage.nodes[self.current].digests}")
        if mode != "async":
            self._saves_done()
        self.check_disk()

    def wait(self) -> None:
        run = self.execute(WAIT_CELL)
        if run.status == "ok" and "@@waited" in run.stdout:
            self._saves_done()

    def load_step(self, step: int, via_magic: bool) -> None:
        candidates = self.disk_candidates(step)
        self.tally.restores["disk, by step"] += 1
        seen = self._load(step, via_magic)
        self._saves_done()  # load() waited for the save in flight
        self._became_one_of(candidates, step, seen, f"load of step {step}")
        self.snapshots.clear()  # a disk load supersedes what memory held

    def load_latest(self, via_magic: bool) -> None:
        latest = layout.read_latest(self.ckpt_dir)
        run_step, seen = self._load_and_step("latest", via_magic)
        self._saves_done()  # load() waited for the save in flight
        from_memory = [n for n in self.memory_candidates() if self.lineage.nodes[n].step == run_step]
        if from_memory and any(self.lineage.matches(n, seen) for n in from_memory):
            self.tally.restores["memory (latest)"] += 1
            self._restored_from_memory(run_step, seen, f"load latest (step {run_step} from memory)")
            return
        self.tally.restores["disk, latest"] += 1
        if latest is not None and run_step != latest:
            self.log(f"  load latest gave step {run_step} while LATEST names {latest}")
        self._became_one_of(self.disk_candidates(run_step), run_step, seen, f"load latest (step {run_step})")
        self.snapshots.clear()

    def load_memory(self, via_magic: bool) -> None:
        candidates = self.memory_candidates()
        before = self.current
        step, seen = self._load_and_step("memory", via_magic, refusal_allowed=True)
        if step is None:
            if candidates:
                self.log(f"  load memory refused with snapshots {candidates} written")
            self._check_current("a refused load of memory changes nothing")
            self.current = before
            return
        self._saves_done()  # load() waited for the save in flight
        self.tally.restores["memory, by hand"] += 1
        self._restored_from_memory(step, seen, f"load memory (step {step})")

    def _load(self, target: int | str, via_magic: bool) -> dict[int, str]:
        step, seen = self._load_and_step(target, via_magic)
        if step is None:
            raise InvariantBroken(f"load of {target!r} failed")
        return seen

    def _load_and_step(self, target: int | str, via_magic: bool,
                       refusal_allowed: bool = False) -> tuple[int | None, dict[int, str]]:
        if via_magic:
            run = self.execute(f"%fsdp2 load {target}")
            if run.status != "ok":
                if refusal_allowed:
                    return None, {}
                raise InvariantBroken(f"%fsdp2 load {target} failed: {self._last_lines(run)}")
            run = self.execute(REPORT_CELL)
        else:
            run = self.execute(LOAD_CELL.format(target=target))
            if run.status != "ok" and refusal_allowed:
                return None, {}
        step, seen = self._one_state(run, f"load of {target!r}")
        return step, seen

    def _became_one_of(self, candidates: list[int], step: int, seen: dict[int, str], what: str) -> None:
        for node in candidates:
            if self.lineage.matches(node, seen):
                self.lineage.observe(node, seen, what)
                self.current = node
                return
        raise InvariantBroken(f"{what}: digests {seen} match none of the saves of step {step}: "
                              f"{[self.lineage.describe(n) for n in candidates]}")

    def set_snapshots(self, on: bool) -> None:
        """Make the checkpointer again with or without snapshots; `track()` may restore one."""
        self.snapshots_on = on
        run = self.execute(RETRACK_CELL.format(ckpt_dir=str(self.ckpt_dir), keep=KEEP,
                                               memory_every=1 if on else None))
        if run.status != "ok" and SAVE_FAILED.search(self._said(run)):  # close() raised a failed save
            run = self.execute(RETRACK_CELL.replace("ckpt.close()\n", "").format(
                ckpt_dir=str(self.ckpt_dir), keep=KEEP, memory_every=1 if on else None))
        self._saves_done_or_failed_by_close()
        step, seen = self._one_state(run, "a new checkpointer")
        if step is None or (step == self.lineage.nodes[self.current].step and self.lineage.matches(self.current, seen)):
            self.lineage.observe(self.current, seen, "a new checkpointer on the same model")
        else:
            self.tally.restores["memory (track)"] += 1
            self._restored_from_memory(step, seen, f"track() restored step {step}")

    def _saves_done_or_failed_by_close(self) -> None:
        """close() waited for the save in flight: what it did not say failed is done."""
        if any(save.outcome == "pending" for save in self.saves):
            self._saves_done()

    def raise_in_collective(self) -> None:
        self.tally.faults["rank raises in a collective"] += 1
        before = dict(self.rank_pids)
        run = self.execute(RAISE_CELL)
        if run.status == "ok":
            raise InvariantBroken("a rank raised, yet its cell ended ok")
        self._same_ranks_after(before, "a rank raised while another waited in a collective", run)

    def interrupt_in_collective(self) -> None:
        self.tally.faults["stop button in a collective"] += 1
        before = dict(self.rank_pids)
        assert self.kernel is not None
        self.num_cells += 1
        self.tally.cells += 1
        try:
            run = self.kernel.execute_and_interrupt(WAITING_CELL, "@@waiting", timeout=CELL_TIMEOUT_S)
        except TimeoutError as error:
            raise InvariantBroken("the stop button did not end a cell waiting in a collective") from error
        self._note_save_failures(run)
        if run.status == "ok":
            raise InvariantBroken("the stop button was pressed, yet the cell ended ok")
        self._same_ranks_after(before, "the stop button while a rank waited in a collective", run)

    def kill_rank_in_cell(self, target_rank: int) -> None:
        """SIGKILL a rank once the first step of a training cell has printed."""
        self.tally.faults["rank killed in a cell"] += 1
        assert self.kernel is not None
        pid = self.rank_pids[target_rank]
        start = self.current
        first = (self.lineage.nodes[start].step if self.lineage.nodes[start].step is not None else -1) + 1
        killed: list[bool] = []

        def on_message(message: dict) -> None:
            if not killed and message["msg_type"] == "stream" and "@@state" in message["content"]["text"]:
                killed.append(True)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        code = TRAIN_CELL.format(line="", first=first, end=first + 6, pace_s=KILL_PACE_S, save_at=-1, save="pass")
        self.num_cells += 1
        self.tally.cells += 1
        try:
            run = self.kernel.execute(code, timeout=CELL_TIMEOUT_S, on_message=on_message)
        except TimeoutError as error:
            raise InvariantBroken(f"the cell whose rank {target_rank} was killed ran past its timeout") from error
        self._note_save_failures(run)
        if run.status == "ok":
            raise InvariantBroken(f"rank {target_rank} was killed inside a cell, yet the cell ended ok")
        node = start
        for step, seen in self._states(run):
            node = self.lineage.child(node, step)
            self.lineage.observe(node, seen, f"step {step} before a rank was killed")
            if self.snapshots_on:
                self.snapshots.append(node)
                self.snapshotted_any = True
        self._pool_lost(f"rank {target_rank} killed in a cell")

    def kill_rank_between_cells(self, target_rank: int) -> None:
        self.tally.faults["rank killed between cells"] += 1
        self._kill_idle(self.rank_pids[target_rank], f"rank {target_rank} killed between cells")

    def kill_agent(self) -> None:
        self.tally.faults["host agent killed"] += 1
        agent = self._agent()
        if agent is None:
            raise InvariantBroken("no host agent found for the ranks")
        self._kill_idle(agent.pid, "the host agent killed between cells")

    def _kill_idle(self, pid: int, what: str) -> None:
        """Kill while no cell runs: the next cell restarts the pool and says so (as for the agent)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(timeout=30)
        run = self.execute(PROBE_CELL)
        said = self._said(run)
        if RESTART_ADVICE in said:
            raise InvariantBroken(f"{what}: the next cell refused instead of restarting the pool: "
                                  f"{self._last_lines(run)}")
        elif "restarted" not in said:
            raise InvariantBroken(f"{what}: the next cell did not say that the pool was restarted: "
                                  f"{self._last_lines(run)}")
        self._pool_lost(what)

    def restart(self) -> None:
        run = self.execute("%fsdp2 restart")
        if run.status != "ok":
            raise InvariantBroken(f"%fsdp2 restart failed: {self._last_lines(run)}")
        self._pool_lost("%fsdp2 restart")

    def rewind(self, num_steps: int, save_mode: str) -> None:
        """Start the loop again from step 0 on the live model (a step that goes backwards)."""
        self.train(num_steps, save_mode, first=0)

    def detach_attach(self) -> None:
        before = dict(self.rank_pids)
        run = self.execute("%fsdp2 detach")
        if run.status != "ok":
            raise InvariantBroken(f"%fsdp2 detach failed: {self._last_lines(run)}")
        run = self.execute(f"%fsdp2 attach {self.pool_name} --no-dashboard")
        if run.status != "ok":
            raise InvariantBroken(f"%fsdp2 attach failed: {self._last_lines(run)}")
        self._same_ranks_after(before, "detach and attach of a kept pool", run)

    # ---- the end --------------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop the pool and the kernel; what of the session is left over."""
        if self.kernel is not None:
            with contextlib.suppress(Exception):
                self.kernel.execute("%fsdp2 stop", timeout=60)
            with contextlib.suppress(Exception):
                self.kernel.stop()
            self.kernel = None
        leftovers = self._leftovers()
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        return leftovers

    def _leftovers(self) -> list[str]:
        found: list[str] = []
        alive = _processes_marked(self.marker)
        for _ in range(50):  # the agent ends its ranks and itself once its kernel is gone
            if not alive:
                break
            psutil.wait_procs(alive, timeout=0.2)
            alive = _processes_marked(self.marker)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                found.append(f"process {process.pid} {' '.join(process.cmdline())[:80]}")
                process.kill()
        found.extend(f"socket {path}" for path in self.private_tmp.rglob("*") if path.is_socket())
        found.extend(f"private dir {path}" for path in self.private_tmp.glob("fsdp2nb-*")
                     if path.name != f"fsdp2nb-{os.getuid()}")
        registry = self.private_tmp / f"fsdp2nb-{os.getuid()}"
        found.extend(f"registry entry {path}" for path in (registry / "pools").glob("*.json"))
        found.extend(f"kept pool {path}" for path in (registry / "kept").glob("*") if path.is_dir())
        found.extend(f"snapshot file {path}" for path in self.snapshot_dir.rglob("*") if path.is_file())
        return found


def _processes_marked(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get("FSDP2NB_SOAK_MARKER") == marker:
                found.append(process)
    return found


# ---- the state machine --------------------------------------------------------------------------

SAVE_MODES = ("none", "async", "async_wait", "sync")


class SessionMachine(RuleBasedStateMachine):
    """Random sessions. The test sets `tally` (sums what every example did) and `seed`;
    `session_type` is what drives the notebook (`Session`, or a stand-in for checking the checker).

    Every choice is an index drawn by Hypothesis as it is, so that its shrinker can delete an action
    without changing the ones after it. Hypothesis's first example draws only zeros: it would be the
    same session for every seed (the first option again and again), so `start` rejects it before any
    kernel starts, and every session run is one of the seed's own random ones."""

    tally = Tally()
    seed = 0
    session_type = Session

    def __init__(self) -> None:
        super().__init__()
        self.session: Session | None = None
        self.started = time.monotonic()
        self.broken = False
        """Whether an invariant broke: the end's check would only hide what broke first."""

    @staticmethod
    def pick(data, options, name: str):
        options = list(options)
        return options[data.draw(st.integers(0, len(options) - 1), label=name)]

    @contextlib.contextmanager
    def _noting_violations(self):
        """Note what broke in the tally before Hypothesis sees it: replaying a session on a real
        kernel may fail otherwise (or not at all), which it reports as flaky."""
        try:
            yield
        except InvariantBroken as error:
            done = self.session.done if self.session is not None else []
            self.tally.violations.append(Violation(self.seed, tuple(done), str(error)))
            self.broken = True
            raise

    @initialize(data=st.data())
    def start(self, data) -> None:
        assume(data.draw(st.integers(0, 255), label="not the all-zero example") != 0)  # see the class docstring
        with self._noting_violations():
            self.session = self.session_type(self.tally, kept=self.pick(data, (False, True), "kept pool"))

    def actions(self) -> list[str]:
        """What a user may do now."""
        session = self.session
        assert session is not None
        possible = list(ACTIONS)
        if not session.loadable_steps():
            possible = [name for name in possible if name not in ("load a step", "load latest")]
        if not session.kept:
            possible.remove("detach and attach")
        return possible

    @rule(data=st.data())
    def act(self, data) -> None:
        with self._noting_violations():
            self._act(data)

    def _act(self, data) -> None:
        session = self.session
        assert session is not None
        name = self.pick(data, self.actions(), "action")
        self.tally.actions[name] += 1
        if name in ("train", "rewind to step 0"):
            num_steps, mode = self.pick(data, range(1, 5), "steps"), self.pick(data, SAVE_MODES, "save mode")
            name = f"{name} {num_steps} steps, save {mode}"
            session.note(name)
            session.train(num_steps, mode, first=0 if name.startswith("rewind") else None)
            return
        if name == "background run":
            num_steps = self.pick(data, range(1, 4), "steps")
            session.note(f"{name} of {num_steps} steps")
            session.train(num_steps, "none", background=True)
            return
        argument = None
        if name == "save":
            argument = self.pick(data, SAVE_MODES[1:], "save mode")
        elif name == "load a step":
            argument = self.pick(data, session.loadable_steps(), "step")
        elif name.startswith("kill a rank"):
            argument = self.pick(data, (0, 1), "rank")
        elif name == "snapshots":
            argument = self.pick(data, (False, True), "snapshots on")
        via_magic = self.pick(data, (False, True), "via magic") if name.startswith("load") else None
        session.note(name + (f" {argument}" if argument is not None else "") + (" (magic)" if via_magic else ""))
        ACTIONS[name](session, argument, via_magic)

    @invariant()
    def disk_agrees(self) -> None:
        if self.session is not None:
            with self._noting_violations():
                self.session.check_disk()

    @invariant()
    def ranks_hold_no_more(self) -> None:
        if self.session is not None:
            with self._noting_violations():
                self.session.check_resources()

    def teardown(self) -> None:
        if self.session is None:
            return
        try:
            if not self.broken:
                with self._noting_violations():
                    self.session.check_resources()  # at the end, before the ranks stop
        finally:
            leftovers = self.session.close()
            self.tally.wall_s += time.monotonic() - self.started
        if leftovers:
            with self._noting_violations():
                raise InvariantBroken(f"left over after the session: {leftovers}")


ACTIONS = {
    "train": None,
    "rewind to step 0": None,
    "background run": None,
    "save": lambda session, mode, _: session.save_now(mode),
    "wait": lambda session, _, __: session.wait(),
    "load a step": lambda session, step, via_magic: session.load_step(step, via_magic),
    "load latest": lambda session, _, via_magic: session.load_latest(via_magic),
    "load memory": lambda session, _, via_magic: session.load_memory(via_magic),
    "snapshots": lambda session, on, _: session.set_snapshots(on),
    "rank raises in a collective": lambda session, _, __: session.raise_in_collective(),
    "stop button in a collective": lambda session, _, __: session.interrupt_in_collective(),
    "kill a rank in a cell": lambda session, rank, _: session.kill_rank_in_cell(rank),
    "kill a rank between cells": lambda session, rank, _: session.kill_rank_between_cells(rank),
    "kill the host agent": lambda session, _, __: session.kill_agent(),
    "%fsdp2 restart": lambda session, _, __: session.restart(),
    "detach and attach": lambda session, _, __: session.detach_attach(),
}
"""Every action by name: what the machine calls with (session, its argument, via the magic)."""


# ---- running seeds ------------------------------------------------------------------------------

def check_seeds(first_seed: int, num_seeds: int, *, actions: int, examples: int, shrink: bool,
                session_type: type = Session) -> tuple[Tally, list[str]]:
    """Run `examples` sessions of up to `actions` actions for each seed; the failures, one per
    failing seed (a later seed still runs). With `shrink`, Hypothesis replays shorter variants of a
    failing session; each failure names the first sequence that failed and the shortest one."""
    tally = Tally()
    failures: list[str] = []
    phases = (Phase.explicit, Phase.generate, Phase.shrink) if shrink else (Phase.explicit, Phase.generate)
    options = settings(max_examples=examples, stateful_step_count=actions, deadline=None, database=None,
                       phases=phases, suppress_health_check=list(HealthCheck), print_blob=True)
    for session_seed in range(first_seed, first_seed + num_seeds):
        machine = type("SeededSessionMachine", (SessionMachine,),
                       {"tally": tally, "seed": session_seed, "session_type": session_type})
        started = time.monotonic()
        try:
            run_state_machine_as_test(seed(session_seed)(machine), settings=options)
        except Exception as error:  # Hypothesis wraps a replay that failed otherwise (flaky)
            failures.append(describe_failure(session_seed, tally.violations, error))
        print(f"seed {session_seed}: {time.monotonic() - started:.0f} s; so far:\n{tally.table()}", flush=True)
    return tally, failures


def shortest_violation(session_seed: int, violations: list[Violation]) -> Violation | None:
    """The failing sequence of that seed with the fewest actions (the first of them if several)."""
    noted = [violation for violation in violations if violation.seed == session_seed]
    return min(noted, key=lambda violation: len(violation.actions)) if noted else None


def describe_failure(session_seed: int, violations: list[Violation], error: BaseException) -> str:
    shortest = shortest_violation(session_seed, violations)
    if shortest is None:
        return f"seed {session_seed}: {type(error).__name__}: {error}"
    first = next(violation for violation in violations if violation.seed == session_seed)
    if first == shortest:
        return str(first)
    return f"{first}\n  shrunk to {len(shortest.actions)} actions: {shortest}"
