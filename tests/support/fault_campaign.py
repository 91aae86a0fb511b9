"""A seeded fault campaign against a notebook that trains with an async checkpointer.

A real ipykernel (driven through jupyter_client) trains a small MLP, sharded with `fully_shard`,
on CPU ranks and saves every few steps with `Checkpointer(dir, keep=3, async_save=True)`. A
seeded scheduler injects one fault at a time at a chosen moment (mid-training, during an async
save, during a load, or before a load), then recovers as a user would: the pool restarts on its
own, a setup cell builds the model again and `%fsdp2 load latest` restores it. Training data is
seeded per step and every op is deterministic, so the final model and optimizer state must equal,
bit for bit, those of a fault-free run to the same step. The checkpointer also keeps every step in
host memory (`memory_every=1`): a fault that ends a process but leaves the host's memory (a rank or
the host agent killed) must be recovered from that snapshot, at the step the restart said it
kept, when it is newer than the disk's newest; a killed kernel's ranks write its newest snapshot
to disk before they end, so a new kernel's `load("latest")` resumes there.

`make soak` runs a long campaign and `tests/faults/` a short one (tests/faults/test_fault_campaign.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from fsdp2nb.checkpoint import layout
from fsdp2nb.host import memory_store
from tests.support.fault_cells import (
    ARMED_LOAD_CELL,
    BATCH,
    CHUNK,
    DEPTH,
    DIGEST_CELL,
    PACE_S,
    PROBE_CELL,
    SAVE_EVERY,
    SETUP_CELL,
    TRAIN_CELL,
    WIDTH,
)
from tests.support.fault_report import ENDS_A_PROCESS, FAULT_KINDS, CampaignResult, FaultRecord, record_line
from tests.support.kernel_client import WITHOUT_GPUS, CellRun, Kernel

DAMAGE_KINDS = ("truncated_shard", "deleted_metadata", "latest_missing_step")
"""Kinds that damage the checkpoint directory before a load (LATEST is broken on purpose)."""

RESTART_ADVICE = "`%fsdp2 restart` starts a fresh"
"""How a cell tells the user that the pool is broken and what to do (a user does it)."""

MOMENTS = {
    "kill_rank": ("train", "save", "load"),
    "kill_agent": ("train", "save", "load"),
    "kill_kernel": ("train", "save", "load"),
    "stop_rank": ("train", "save"),
    "stop_rank_forever": ("train", "save"),
    "raise_in_collective": ("train", "save", "load"),
    "interrupt_twice": ("train", "save", "load"),
    "enospc": ("save",),
    "truncated_shard": ("before_load",),
    "deleted_metadata": ("before_load",),
    "latest_missing_step": ("before_load",),
}
"""When each kind may strike: during the training loop, while an async save writes, while
`%fsdp2 load latest` runs, or on the disk before a load."""

TMPFS_BYTES = 48 << 20
"""Room for keep=3 checkpoints (about 1.8 MiB each), one in flight and one being replaced."""

class _Triggered(Exception):
    """Raised from a message callback to stop reading a cell's output at the fault's moment."""


class Campaign:
    """One seeded campaign: `run()` injects `num_faults` faults and returns a CampaignResult."""

    def __init__(self, *, seed: int, num_faults: int, num_ranks: int = 2, kinds: tuple[str, ...] = FAULT_KINDS,
                 collective_timeout_s: float = 5.0, cell_timeout_s: float | None = None, workdir: str | None = None,
                 log=print) -> None:
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"kinds={sorted(unknown)} are unknown; choose from {FAULT_KINDS}")
        self.seed, self.num_faults, self.num_ranks = seed, num_faults, num_ranks
        self.kinds = kinds
        self.collective_timeout_s = collective_timeout_s
        # A rank stopped in a collective ends its cell after the collective timeout, the 3 s the
        # others get after an error, the 5 s interrupt grace and a pool restart: allow for a slow machine.
        self.cell_timeout_s = cell_timeout_s or collective_timeout_s + 45.0
        self.log = log
        self.rng = random.Random(seed)
        self.root = Path(workdir or tempfile.mkdtemp(prefix="fsdp2nb-soak-"))
        self.private_tmp = self.root / "tmp"  # the kernel's TMPDIR: the pools' private dirs land here
        self.ckpt_dir = self.root / "ckpt"
        self.marker = f"soak-{uuid.uuid4().hex[:12]}"
        self.kernel: Kernel | None = None
        self.position = 0  # the next step to train
        self.highest_trained = -1
        self.tmpfs_mounted = False
        self.tmpfs_refused = ""
        self.seen_pids: set[int] = set()
        self.shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    # ---- the campaign -------------------------------------------------------------------------

    def run(self) -> CampaignResult:
        started = time.monotonic()
        self.private_tmp.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self._mount_tmpfs()
        records: list[FaultRecord] = []
        digests: tuple[str, ...] = ()
        reference: tuple[str, ...] = ()
        try:
            self._new_kernel()
            self._must_recover("start")
            schedule = self._schedule()
            for number, kind in enumerate(schedule, 1):
                record = self._one_fault(number, kind)
                records.append(record)
                self.log(record_line(record))
            final_step = self.position + CHUNK - 1
            self._train_until(final_step + 1)
            digests = self._digests()
            reference = self._reference_digests(final_step)
        finally:
            self._stop_kernel()
            self._unmount_tmpfs()
        orphans, foreign = self._orphans()
        return CampaignResult(seed=self.seed, num_ranks=self.num_ranks, records=records, final_step=final_step,
                              digests=digests, reference_digests=reference, orphans=orphans, foreign_shm=foreign,
                              wall_s=time.monotonic() - started)

    def _schedule(self) -> list[str]:
        """Every enabled kind about equally often, in a seeded order."""
        kinds = list(self.kinds)
        schedule: list[str] = []
        while len(schedule) < self.num_faults:
            self.rng.shuffle(kinds)
            schedule.extend(kinds)
        return schedule[:self.num_faults]

    def _one_fault(self, number: int, kind: str) -> FaultRecord:
        record = FaultRecord(number=number, kind=kind, moment=self.rng.choice(MOMENTS[kind]))
        if kind == "enospc" and not self.tmpfs_mounted:
            record.skipped = f"no tmpfs for the checkpoints: {self.tmpfs_refused}"
            return record
        if record.moment in ("before_load", "load") and layout.read_latest(self.ckpt_dir) is None:
            self._train_until(self.position + SAVE_EVERY + 1)  # something to damage or load
        record.latest_before = self._step_latest_resolves_to()
        ranks_before = [process.pid for process in self._rank_processes()]
        struck_at = time.monotonic()
        if record.moment in ("train", "save"):
            struck_at = self._strike_while_training(record)
        elif record.moment == "load":
            struck_at = self._strike_while_loading(record)
        else:
            self._damage(record)
        self._check_latest(record)
        record.state_kept = bool(ranks_before) and ranks_before == [process.pid for process in self._rank_processes()]
        if not record.state_kept and record.kind not in ENDS_A_PROCESS:
            record.problems.append("every process stayed alive, yet the ranks were replaced and their state lost")
        self._recover(record, struck_at)
        self._check_memory_used(record)
        if record.kind in DAMAGE_KINDS:  # saves over the damaged step, so later faults meet a sound directory
            self._train_until(self.position + CHUNK)
        return record

    # ---- striking -----------------------------------------------------------------------------

    def _strike_while_training(self, record: FaultRecord) -> float:
        first, end = self.position, self.position + CHUNK
        if record.kind == "enospc":
            self._fill_tmpfs(record)
            trigger = re.compile(r"saving \d+")
        elif record.moment == "save":
            trigger = re.compile(r"saving \d+")
        else:
            trigger = re.compile(rf"step {self.rng.randrange(first, first + CHUNK // 2)}\b")
        kernel = self.kernel
        msg_id = kernel.submit(TRAIN_CELL.format(first=first, end=end, save_every=SAVE_EVERY))
        seen: list[str] = []

        def watch(message: dict) -> None:
            if message["msg_type"] == "stream":
                seen.append(message["content"]["text"])
                if trigger.search(message["content"]["text"]):
                    raise _Triggered

        struck_at = time.monotonic()
        finished = None
        try:
            finished = kernel.collect(msg_id, timeout=self.cell_timeout_s, on_message=watch)
        except _Triggered:
            if record.kind != "enospc":
                time.sleep(self.rng.uniform(0.0, 0.05))
                struck_at = time.monotonic()
                record.struck = self._inject(record)
        except TimeoutError:
            record.problems.append("the training cell hung before the fault")
        self._note_steps("".join(seen))
        if record.kind == "enospc":
            record.struck = finished is None or finished.status == "error"
        if finished is None:
            finished = self._finish_cell(record, msg_id)
        if finished is not None:
            self._note_steps(finished.stdout)
            record.cell_outcome = _outcome(finished)
            self._note_kept_in_memory(record, finished.traceback_text + finished.stderr)
            record.struck = record.struck and finished.status == "error"
        self._empty_tmpfs_filler()
        return struck_at

    def _strike_while_loading(self, record: FaultRecord) -> float:
        self._setup_cell(record)
        msg_id = self.kernel.submit(ARMED_LOAD_CELL if record.kind == "raise_in_collective" else "%fsdp2 load latest")
        time.sleep(self.rng.uniform(0.0, 0.15))
        struck_at = time.monotonic()
        record.struck = self._inject(record)
        finished = self._finish_cell(record, msg_id)
        if finished is not None:
            record.cell_outcome = _outcome(finished)
            self._note_kept_in_memory(record, finished.traceback_text + finished.stderr)
            record.struck = record.struck and finished.status == "error"
        return struck_at

    def _finish_cell(self, record: FaultRecord, msg_id: str):
        """The rest of a struck cell, or None where the kernel is gone or the cell hung."""
        if record.kind == "kill_kernel":
            return None
        try:
            return self.kernel.collect(msg_id, timeout=self.cell_timeout_s)
        except TimeoutError:
            record.problems.append(f"the struck cell did not end within {self.cell_timeout_s:.0f} s")
            self._unstick_kernel(msg_id)
            return None

    def _unstick_kernel(self, msg_id: str) -> None:
        """Press the stop button; a kernel that still does not answer is replaced."""
        self.kernel.manager.interrupt_kernel()
        try:
            self.kernel.collect(msg_id, timeout=15)
        except TimeoutError:
            self.log("  the kernel did not answer the stop button: killing it")
            self._kill_kernel()

    def _inject(self, record: FaultRecord) -> bool:
        """Do the fault; False when its target was already gone."""
        ranks = self._rank_processes()
        kind = record.kind
        if kind == "interrupt_twice":
            self.kernel.manager.interrupt_kernel()
            time.sleep(0.05)
            self.kernel.manager.interrupt_kernel()
            return True
        if kind == "kill_kernel":
            self._kill_kernel()
            return True
        if kind == "kill_agent":
            agent = self._agent_process()
            record.detail = f"agent pid {agent.pid if agent else None}"
            return _signal(agent, signal.SIGKILL)
        if not ranks:
            record.detail = "no rank to strike"
            return False
        target_rank = self.rng.randrange(len(ranks))
        target = ranks[target_rank]
        record.detail = f"rank {target_rank} pid {target.pid}"
        if kind == "kill_rank":
            return _signal(target, signal.SIGKILL)
        if kind == "raise_in_collective":
            return _signal(target, signal.SIGUSR1)
        if kind in ("stop_rank", "stop_rank_forever"):
            struck = _signal(target, signal.SIGSTOP)
            if kind == "stop_rank":
                timer = threading.Timer(self.collective_timeout_s + 2.0, _signal, (target, signal.SIGCONT))
                timer.daemon = True
                timer.start()
            return struck
        raise AssertionError(kind)

    def _damage(self, record: FaultRecord) -> None:
        """Break the checkpoint LATEST names, or LATEST itself, as a disk or a person might."""
        step = layout.read_latest(self.ckpt_dir)
        step_dir = self.ckpt_dir / layout.step_dir_name(step)
        if record.kind == "truncated_shard":
            shard = sorted(step_dir.glob("*.distcp"))[0]
            with open(shard, "r+b") as file:
                file.truncate(os.path.getsize(shard) // 2)
            record.detail = f"{shard.name} of step {step} cut to half"
        elif record.kind == "deleted_metadata":
            (step_dir / layout.DCP_METADATA_FILE).unlink()
            record.detail = f".metadata of step {step} deleted"
        else:
            missing = step + 1000
            (self.ckpt_dir / layout.LATEST_FILE).write_text(layout.step_dir_name(missing) + "\n")
            record.detail = f"LATEST names step {missing}, which does not exist (step {step} does)"
        record.struck = True
        record.latest_before = self._newest_intact_step(excluding=step if record.kind != "latest_missing_step" else None)

    # ---- recovering ---------------------------------------------------------------------------

    def _recover(self, record: FaultRecord, struck_at: float) -> None:
        """As a user would: the pool restarted itself; run the setup cell, then load latest."""
        for path in ("user", "%fsdp2 restart", "new kernel"):
            if path == "%fsdp2 restart" and self.kernel is not None:
                try:
                    self.kernel.execute("%fsdp2 restart", timeout=self.cell_timeout_s)
                except TimeoutError:
                    self._kill_kernel()
            if path == "new kernel" or self.kernel is None:
                self._kill_kernel()
                self._new_kernel()
            if self._try_recover(record):
                record.recover_s = time.monotonic() - struck_at
                record.recovery_path = path if record.kind != "kill_kernel" else "new kernel (the fault)"
                record.recovered = path == "user" or (path == "new kernel" and record.kind == "kill_kernel")
                break
        else:
            raise RuntimeError(f"fault {record.number} ({record.kind}): no recovery worked; see the log above")
        redone_from = record.restored_step if record.restored_step is not None else -1
        record.from_memory = record.from_memory and redone_from >= 0
        record.steps_redone = max(0, self.highest_trained - redone_from)
        if record.latest_before is not None and redone_from < record.latest_before:  # step 0 is a step
            record.checkpoint_lost = True
            record.problems.append(f"restored step {record.restored_step} < step {record.latest_before} "
                                   "that LATEST named before the fault")

    def _try_recover(self, record: FaultRecord) -> bool:
        if self.kernel is None:
            self._new_kernel()
        if not self._setup_cell(record):
            # A rank that died while the kernel was idle is reported by the next cell, which
            # restarts the pool: a user runs the setup cell again.
            if self.kernel is None or not self._setup_cell(record):
                return False
        loaded = self._load_latest(record)
        if loaded is None or not self._collectives_work(record):
            # A collective left waiting by the fault may time out only now, after the set-up:
            # the probe's error then says to restart, and a user does, then sets up again.
            if not record.restart_told or record.retried_after_restart:
                return False
            record.retried_after_restart = True
            return self._try_recover(record)
        record.restored_step = loaded
        self.position = loaded + 1 if loaded >= 0 else 0
        return True

    def _must_recover(self, why: str) -> None:
        record = FaultRecord(number=0, kind=why, moment="")
        if not self._try_recover(record):
            raise RuntimeError(f"the notebook could not be set up ({why}): {record.problems}")

    def _execute_or_kill(self, record: FaultRecord, code: str, *, hung: str) -> CellRun | None:
        """Run a cell; one that does not end within the cell timeout is noted as the problem `hung`
        and its kernel killed (None), as a user would after waiting that long."""
        try:
            return self.kernel.execute(code, timeout=self.cell_timeout_s)
        except TimeoutError:
            record.problems.append(hung)
            self._kill_kernel()
            return None

    def _collectives_work(self, record: FaultRecord) -> bool:
        """The default process group still carries a collective, as the next training cell needs."""
        run = self._execute_or_kill(record, PROBE_CELL, hung="a collective after the recovery hung")
        if run is None:
            return False
        if run.status == "ok" and f"sum {self.num_ranks}" in run.stdout:
            return True
        said = run.traceback_text + run.stderr
        if RESTART_ADVICE in said:
            record.notes.append(f"a collective after the recovery failed: {_last_line(said)}")
            self._restart_as_told(record)
            return False
        record.problems.append(f"a collective after the recovery failed: {_last_line(run.traceback_text)} "
                               f"... {run.traceback_text.strip().splitlines()[-1][:200] if run.traceback_text else ''}")
        return False

    def _setup_cell(self, record: FaultRecord) -> bool:
        started = time.monotonic()
        code = SETUP_CELL.format(width=WIDTH, depth=DEPTH, batch=BATCH, pace_s=PACE_S, ckpt_dir=str(self.ckpt_dir))
        run = self._execute_or_kill(record, code, hung="the setup cell hung")
        if run is None:
            return False
        self._note_kept_in_memory(record, run.stderr + run.traceback_text)
        if run.status != "ok":
            said = run.traceback_text + run.stderr  # a refusal (UsageError) comes as stderr
            record.notes.append(f"setup cell failed after {time.monotonic() - started:.1f} s: {_last_line(said)}")
            if RESTART_ADVICE in said:
                self._restart_as_told(record)  # what the error tells the user to do
            return False
        record.from_memory = record.from_memory or "from memory" in run.stdout
        self._remember_pids()
        return True

    def _restart_as_told(self, record: FaultRecord) -> None:
        run = self._execute_or_kill(record, "%fsdp2 restart", hung="`%fsdp2 restart` hung")
        if run is None:
            return
        record.notes.append(f"%fsdp2 restart, as the cell said: {run.status}")
        self._note_kept_in_memory(record, run.stdout)
        record.restart_told = True

    def _load_latest(self, record: FaultRecord) -> int | None:
        """The restored step (-1: nothing saved yet), or None when `%fsdp2 load latest` failed."""
        if layout.read_latest(self.ckpt_dir) is None and not any(e.valid for e in layout.list_entries(self.ckpt_dir)):
            return -1
        run = self._execute_or_kill(record, "%fsdp2 load latest", hung="`%fsdp2 load latest` hung")
        if run is None:
            return None
        match = re.search(r"loaded step (\d+)", run.stdout)
        if run.status == "ok" and match:
            record.from_memory = record.from_memory or "from memory" in run.stdout
            return int(match.group(1))
        record.problems.append(f"`%fsdp2 load latest` failed: {_last_line(run.traceback_text)}")
        return self._load_older(record)

    def _load_older(self, record: FaultRecord) -> int | None:
        """What a user does after a failed `load latest`: name the newest step that loads."""
        for entry in reversed(layout.list_entries(self.ckpt_dir)):
            if not entry.valid:
                continue
            run = self.kernel.execute(f"%fsdp2 load {entry.step}", timeout=self.cell_timeout_s)
            if run.status == "ok":
                record.detail += f"; loaded step {entry.step} by name"
                return entry.step
        return None

    # ---- checks -------------------------------------------------------------------------------

    def _note_kept_in_memory(self, record: FaultRecord, said: str) -> None:
        """What a restart's note (in a struck cell or the next one) says is kept in host memory."""
        match = re.search(r"step (\d+) of \S+ \([^)]*of host memory\)", said)
        if match and record.kept_in_memory is None:
            record.kept_in_memory = int(match.group(1))

    def _check_memory_used(self, record: FaultRecord) -> None:
        """A snapshot the restart said was kept, newer than the disk's newest, is what comes back."""
        kept = record.kept_in_memory
        if kept is None or record.restored_step is None:
            return
        if kept > (record.latest_before if record.latest_before is not None else -1) and record.restored_step < kept:
            record.problems.append(f"step {kept} was kept in memory, but step {record.restored_step} was restored")

    def _check_latest(self, record: FaultRecord) -> None:
        """LATEST must name a complete checkpoint after any fault that did not break it on purpose."""
        if record.kind in DAMAGE_KINDS:
            return
        step = layout.read_latest(self.ckpt_dir)
        if step is None:
            record.latest_ok = record.latest_before is None or record.latest_before == -1
        else:
            step_dir = self.ckpt_dir / layout.step_dir_name(step)
            record.latest_ok = layout.is_complete(step_dir, layout.read_metadata(step_dir))
        if not record.latest_ok:
            record.problems.append(f"LATEST names step {step}, which is not a complete checkpoint")

    def _step_latest_resolves_to(self) -> int | None:
        """The step LATEST names when that is a complete checkpoint, else the newest complete one."""
        step = layout.read_latest(self.ckpt_dir)
        if step is not None:
            step_dir = self.ckpt_dir / layout.step_dir_name(step)
            if layout.is_complete(step_dir, layout.read_metadata(step_dir)):
                return step
        return self._newest_intact_step(excluding=None)

    def _newest_intact_step(self, excluding: int | None) -> int | None:
        steps = [e.step for e in layout.list_entries(self.ckpt_dir) if e.valid and e.step != excluding]
        return steps[-1] if steps else None

    def _orphans(self) -> tuple[list[str], list[str]]:
        """Processes, private dirs, sockets and shared memory of the campaign's pools still present."""
        found: list[str] = []
        deadline = time.monotonic() + 10
        while True:
            alive = _processes_marked(self.marker)
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for process in alive:
            found.append(f"process {process.pid} {' '.join(_cmdline(process))[:80]}")
            _signal(process, signal.SIGKILL)
        for path in self.private_tmp.rglob("*"):
            if path.is_socket():
                found.append(f"socket {path}")
        for path in self.private_tmp.glob("fsdp2nb-*"):
            if path.name != f"fsdp2nb-{os.getuid()}":
                found.append(f"private dir {path}")
        registry = self.private_tmp / f"fsdp2nb-{os.getuid()}"
        found.extend(f"registry entry {path}" for path in (registry / "pools").glob("*.json"))
        stores = memory_store.stores_root()
        found.extend(f"snapshot store {path}" for path in stores.glob("session-*")
                     if any(path.name.startswith(f"session-{pid}-") for pid in self.seen_pids))
        foreign: list[str] = []
        if os.path.isdir("/dev/shm"):
            for name in sorted(set(os.listdir("/dev/shm")) - self.shm_before):
                if any(str(pid) in name for pid in self.seen_pids):
                    found.append(f"/dev/shm/{name}")
                else:
                    foreign.append(name)
        return found, foreign

    # ---- training and digests -----------------------------------------------------------------

    def _train_until(self, end: int) -> None:
        while self.position < end:
            last = min(end, self.position + CHUNK)
            run = self.kernel.execute(TRAIN_CELL.format(first=self.position, end=last, save_every=SAVE_EVERY),
                                      timeout=self.cell_timeout_s)
            if run.status != "ok":
                raise RuntimeError(f"fault-free training failed: {run.traceback_text[-2000:]}")
            self._note_steps(run.stdout)
            self.position = last

    def _digests(self) -> tuple[str, ...]:
        run = self.kernel.execute(DIGEST_CELL, timeout=self.cell_timeout_s)
        match = re.search(r"digest (\w+) (\w+)", run.stdout)
        if run.status != "ok" or not match:
            raise RuntimeError(f"digest cell failed: {run.traceback_text[-2000:]}")
        return match.groups()

    def _reference_digests(self, final_step: int) -> tuple[str, ...]:
        """The same training, fault-free, from step 0 into a checkpoint directory of its own."""
        reference_dir = self.root / "reference-ckpt"
        code = SETUP_CELL.format(width=WIDTH, depth=DEPTH, batch=BATCH, pace_s=PACE_S, ckpt_dir=str(reference_dir))
        run = self.kernel.execute(code, timeout=self.cell_timeout_s)
        if run.status != "ok":
            raise RuntimeError(f"reference setup failed: {run.traceback_text[-2000:]}")
        self.position = 0
        self._train_until(final_step + 1)
        return self._digests()

    def _note_steps(self, text: str) -> None:
        steps = [int(s) for s in re.findall(r"step (\d+)", text)]
        if steps:
            self.highest_trained = max(self.highest_trained, max(steps))

    # ---- processes ----------------------------------------------------------------------------

    def _new_kernel(self) -> None:
        env = {**WITHOUT_GPUS, "TMPDIR": str(self.private_tmp), "FSDP2NB_SOAK_MARKER": self.marker}
        self.kernel = Kernel(env=env)
        self.seen_pids.add(self.kernel.pid)
        run = self.kernel.execute("%load_ext fsdp2nb", timeout=self.cell_timeout_s)
        assert run.status == "ok", run.traceback_text
        run = self.kernel.execute(f"%fsdp2 start --cpu {self.num_ranks} --timeout {self.collective_timeout_s:g}",
                                  timeout=self.cell_timeout_s)  # shows the dashboard
        if run.status != "ok":
            raise RuntimeError(f"the pool did not start: {run.traceback_text[-2000:]}")
        self._remember_pids()

    def _kill_kernel(self) -> None:
        if self.kernel is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.kernel.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # reaped at once, as a notebook server does
            self.kernel.manager.provisioner.process.wait(timeout=10)
        self.kernel.client.stop_channels()
        with contextlib.suppress(Exception):
            self.kernel.manager.cleanup_resources()
        self.kernel = None

    def _stop_kernel(self) -> None:
        if self.kernel is not None:
            with contextlib.suppress(Exception):
                self.kernel.execute("%fsdp2 stop", timeout=60)
            with contextlib.suppress(Exception):
                self.kernel.stop()
            self.kernel = None

    def _agent_process(self) -> psutil.Process | None:
        if self.kernel is None:
            return None
        with contextlib.suppress(psutil.Error):
            agents = [child for child in psutil.Process(self.kernel.pid).children()
                      if "fsdp2nb.worker.agent" in " ".join(_cmdline(child))]
            # The pool's agent, not the standby waiting for the next launch: started after it.
            return min(agents, key=lambda p: p.create_time()) if agents else None
        return None

    def _rank_processes(self) -> list[psutil.Process]:
        """The ranks, in rank order (the agent forks them in that order)."""
        agent = self._agent_process()
        if agent is None:
            return []
        with contextlib.suppress(psutil.Error):
            return sorted(agent.children(), key=lambda p: p.create_time())
        return []

    def _remember_pids(self) -> None:
        agent = self._agent_process()
        if agent is not None:
            self.seen_pids.add(agent.pid)
        self.seen_pids.update(p.pid for p in self._rank_processes())

    # ---- the tmpfs for ENOSPC -----------------------------------------------------------------

    def _mount_tmpfs(self) -> None:
        if "enospc" not in self.kinds:
            return
        command = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(self.ckpt_dir)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode == 0:
            self.tmpfs_mounted = True
        else:
            self.tmpfs_refused = (result.stderr.strip() or f"mount exited with {result.returncode}")
            self.log(f"ENOSPC faults skipped: mounting a tmpfs was refused ({self.tmpfs_refused})")

    def _unmount_tmpfs(self) -> None:
        if self.tmpfs_mounted:
            subprocess.run(["umount", "--lazy", str(self.ckpt_dir)], check=False)
            self.tmpfs_mounted = False

    def _fill_tmpfs(self, record: FaultRecord) -> None:
        """Leave less room than one checkpoint, so the next save fails with ENOSPC."""
        free = shutil.disk_usage(self.ckpt_dir).free
        filler = self.ckpt_dir / ".soak-filler"
        with open(filler, "wb") as file:
            os.posix_fallocate(file.fileno(), 0, max(0, free - (64 << 10)))
        record.detail = f"tmpfs filled to {64} KiB free"

    def _empty_tmpfs_filler(self) -> None:
        (self.ckpt_dir / ".soak-filler").unlink(missing_ok=True)


# ---- helpers -----------------------------------------------------------------------------------

def _signal(process: psutil.Process | None, signum: int) -> bool:
    if process is None:
        return False
    try:
        process.send_signal(signum)
        return True
    except psutil.Error:
        return False


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


def _processes_marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries the campaign's marker (kernels, agents, ranks)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if process.environ().get("FSDP2NB_SOAK_MARKER") == marker:
                found.append(process)
    return found


def _outcome(run) -> str:
    if run.status == "ok":
        return "ok"
    restarted = "; the pool was restarted" if "pool was restarted" in run.traceback_text else ""
    return _last_line(run.traceback_text)[:120] + restarted


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
