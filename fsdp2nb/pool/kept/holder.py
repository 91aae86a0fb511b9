"""Kept pools on the kernel's side: their directories, who holds them, and handing over (what
`%fsdp2 pools` lists is pool/kept/listing.py's).

A kept pool (`%fsdp2 start --keep`) lives in `<state dir>/kept/<name>/` (0700; see pool/kept/directory.py
for what the directory holds). Only this user can read its key, so only this user can list or
attach it. One kernel holds a pool at a time: the attach record names it, and every change of
holder happens under an exclusive lock on the directory's `lock` file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeGuard

import psutil

from fsdp2nb.atomic_files import replace_atomically
from fsdp2nb.errors import InvalidValue, KeptPoolUnreadable, LaunchError, PoolHeldError, WireVersionMismatch
from fsdp2nb.host.process_identity import own_process_key
from fsdp2nb.host.rank_logs import rank_log_path, read_tail
from fsdp2nb.pool import reaper
from fsdp2nb.pool.kept.directory import (
    KEY_FILE,
    META_FILE,
    read_attach_envelope,
    read_attach_record,
    write_attach_record,
)
from fsdp2nb.pool.launcher import AgentExit, LaunchedRanks, describe_exit
from fsdp2nb.pool.spec import Placement, PoolSpec
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.launch_plan import LaunchPlan
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.versions import ours

DEFAULT_KEEP_FOR_S = 3600.0
"""A kept pool that no kernel holds and that runs nothing ends after an hour unless told otherwise."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
RUNS_FILE = "runs.json"
"""The pool's recent background runs (cell number, `--name`, kernel), by request id."""
_RUNS_KEPT = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepOptions:
    """How a pool is kept beyond its kernel (`--keep [--name NAME] [--keep-for DURATION]`)."""

    name: str
    """The pool's name, which `%fsdp2 attach NAME` gives."""
    keep_for_s: float | None = DEFAULT_KEEP_FOR_S
    """Unheld and idle this long, the pool ends itself; None: it waits for `%fsdp2 stop`."""

    def __post_init__(self) -> None:
        check_pool_name(self.name)
        if self.keep_for_s is not None and not 0 < self.keep_for_s < float("inf"):
            raise InvalidValue(f"keep_for_s={self.keep_for_s!r} must be more than 0 seconds, or None")


def check_pool_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise InvalidValue(f"--name {name!r} is not a pool name: use letters, digits, '_', '.', '-' "
                           "(at most 64, starting with a letter or digit)")


def parse_keep_for(text: str) -> float | None:
    """`90s`, `30m`, `2h`, `1d` -> seconds; `none` -> None (kept until `%fsdp2 stop`)."""
    if text.strip().lower() == "none":
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text.lower())
    if match is None or float(match.group(1)) <= 0:
        raise InvalidValue(f"--keep-for {text!r} is not a duration: give a number and a unit, "
                           "e.g. 90s, 30m, 2h, 1d, or 'none' to keep the pool until `%fsdp2 stop`")
    return float(match.group(1)) * _UNITS[match.group(2)]


def kept_root() -> Path:
    path = reaper.state_dir() / "kept"
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def default_pool_name() -> str:
    """`pool-1`, or the first `pool-N` no kept pool of this user has."""
    taken = {path.name for path in kept_root().iterdir()}
    return next(f"pool-{n}" for n in range(1, len(taken) + 2) if f"pool-{n}" not in taken)


def kept_dir(name: str) -> Path:
    check_pool_name(name)
    return kept_root() / name


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptMeta:
    """What `pool.json` says of a kept pool: written by the kernel that started it.

    The file keeps its flat layout (`to_json`): a kernel of an earlier release lists pools by
    reading it, and removes the directory of a pool whose file it cannot read."""

    keep: KeepOptions
    """Its name and --keep-for."""
    spec: PoolSpec
    """Its ranks: devices, collective timeout and, across hosts, the placement."""
    pool_id: str
    agent: tuple[int, float]
    """The host agent's (pid, start time); across hosts, the Ray driver's."""
    log_dir: str
    runtime_dir: str
    created: float
    listen: str = ""
    """A pool across hosts: the address kernels that attach listen on (pool/kept/on_ray.py)."""

    @property
    def name(self) -> str:
        return self.keep.name

    @property
    def keep_for_s(self) -> float | None:
        return self.keep.keep_for_s

    def to_json(self) -> dict:
        """The file's fields, as every release has written them."""
        spec = self.spec
        return {"name": self.keep.name, "pool_id": self.pool_id, "devices": list(spec.devices),
                "collective_timeout_s": spec.collective_timeout_s, "keep_for_s": self.keep.keep_for_s,
                "agent": list(self.agent), "log_dir": self.log_dir, "runtime_dir": self.runtime_dir,
                "created": self.created, "placement": asdict(spec.placement) if spec.placement else None,
                "listen": self.listen}

    @classmethod
    def from_json(cls, fields: dict) -> KeptMeta:
        placement = Placement(**fields["placement"]) if fields.get("placement") else None
        spec = PoolSpec(devices=tuple(fields["devices"]), collective_timeout_s=fields["collective_timeout_s"],
                        placement=placement)
        pid, started = fields["agent"]
        return cls(keep=KeepOptions(name=fields["name"], keep_for_s=fields["keep_for_s"]), spec=spec,
                   pool_id=fields["pool_id"], agent=(pid, started), log_dir=fields["log_dir"],
                   runtime_dir=fields["runtime_dir"], created=fields["created"], listen=fields.get("listen", ""))

    def write(self, directory: Path) -> None:
        replace_atomically(directory / META_FILE, json.dumps(self.to_json()).encode())

    @classmethod
    def read(cls, directory: Path) -> KeptMeta | None:
        try:
            return cls.from_json(json.loads((directory / META_FILE).read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None


def read_key(directory: Path) -> bytes:
    path = directory / KEY_FILE
    info = os.lstat(path)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise KeptPoolUnreadable(f"{path} must be this user's and readable by no one else (0600)")
    return bytes.fromhex(path.read_text())


def write_key(directory: Path, key: bytes) -> None:
    fd = os.open(directory / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as key_file:
        key_file.write(key.hex())


@contextlib.contextmanager
def holder_lock(directory: Path) -> Iterator[None]:
    """Exclusive while the attach record is read and rewritten (two attaches at once)."""
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def agent_alive(meta: KeptMeta) -> bool:
    return reaper.is_alive(meta.agent)


def wake_agent(meta: KeptMeta) -> None:
    """SIGUSR1 to the pool's agent (checked by start time: a reused pid gets nothing)."""
    if agent_alive(meta):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(meta.agent[0], signal.SIGUSR1)


def check_wire_version(directory: Path, signer: Signer, meta: KeptMeta) -> None:
    """Raise WireVersionMismatch (one line: both versions, and what to do) where the pool's attach
    record was written by an fsdp2nb of another wire version; KeptPoolUnreadable where the key
    verifies no record. Read before this kernel writes anything there."""
    opened = read_attach_envelope(str(directory), signer)
    if opened is None:
        raise KeptPoolUnreadable(f"the key in {directory} does not verify the pool's attach record; the pool "
                                 f"cannot be attached (`kill` its agent, pid {meta.agent[0]}, to end it)")
    if opened.message is not None:
        return
    theirs = opened.version
    attach = (f"install fsdp2nb {theirs.package} (`pip install -e .` in a checkout of it) and restart the kernel "
              "to attach it" if theirs.package
              else "attach it from a kernel with the fsdp2nb that started it")
    raise WireVersionMismatch(
        f"kept pool {meta.name!r} speaks {theirs.describe(ours())}, this kernel speaks "
        f"{ours().describe(theirs)}: {attach}, or end it with `kill {meta.agent[0]}` (its host agent; "
        "rank state is lost)")


def holder_alive(record: AttachRecord | None) -> TypeGuard[AttachRecord]:
    if record is None or not record.holder_pid:
        return False
    return reaper.is_alive((record.holder_pid, record.holder_start_time))


def describe_holder(record: AttachRecord) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(record.since))
    return f"kernel {record.holder_pid} (since {when})"


def hold(directory: Path, signer: Signer, address: str, *, take: bool, name: str) -> AttachRecord:
    """Make this kernel the holder, listening at `address`; raises PoolHeldError if another live
    kernel holds it and `take` is not given. The caller then wakes the agent."""
    with holder_lock(directory):
        current = read_attach_record(str(directory), signer)
        if holder_alive(current) and current.holder_pid != os.getpid() and not take:
            raise PoolHeldError(f"pool {name!r} is held by {describe_holder(current)}; "
                                f"`%fsdp2 attach {name} --take` moves it to this kernel")
        record = AttachRecord(serial=(current.serial if current else 0) + 1, address=address,
                              holder_pid=os.getpid(), holder_start_time=own_process_key()[1], since=time.time())
        write_attach_record(str(directory), signer, record)
        return record


def let_go(directory: Path, signer: Signer) -> bool:
    """Write that no kernel holds the pool, if this kernel still does; returns whether it did."""
    with holder_lock(directory):
        current = read_attach_record(str(directory), signer)
        if current is None or current.holder_pid != os.getpid():
            return False
        write_attach_record(str(directory), signer, AttachRecord(
            serial=current.serial + 1, address="", holder_pid=0, holder_start_time=0.0, since=time.time()))
        return True


def held_here(directory: Path, signer: Signer) -> AttachRecord | None:
    """None while this kernel holds the pool; else the record that says who does."""
    current = read_attach_record(str(directory), signer)
    return None if current is not None and current.holder_pid == os.getpid() else current


def describe_ranks(ranks: list[int]) -> str:
    """`rank 0`, `ranks 0-3` (consecutive) or `ranks 0, 2`."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"


def describe_deaths(reports: Iterable[RankExited]) -> str:
    """`rank 1 died (exit code 3)`, one clause per rank."""
    return "; ".join(f"rank {report.rank} died ({describe_exit(report)})"
                     for report in sorted(reports, key=lambda report: report.rank))


@dataclass(frozen=True, slots=True)
class NotedRun:
    """A background run of a kept pool, as the kernel that started it noted it (`runs.json`)."""

    execution_count: int | None
    name: str | None
    kernel_pid: int
    started: float


def note_run(directory: Path, cell_id: int, run: NotedRun) -> None:
    """Keep what a kernel that attaches later needs to name a background run it takes over."""
    runs = noted_runs(directory)
    runs[cell_id] = run
    recent = dict(sorted(runs.items())[-_RUNS_KEPT:])
    replace_atomically(directory / RUNS_FILE,
                       json.dumps({str(cell_id): asdict(run) for cell_id, run in recent.items()}).encode())


def noted_runs(directory: Path) -> dict[int, NotedRun]:
    """Request id -> the background run it is (the last few)."""
    try:
        return {int(cell_id): NotedRun(**fields)
                for cell_id, fields in json.loads((directory / RUNS_FILE).read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def log_tails(log_dir: str, world_size: int, num_lines: int = 5) -> dict[int, list[str]]:
    """The last lines each rank wrote to its log (what it printed while no kernel held it)."""
    tails = {rank: read_tail(rank_log_path(log_dir, rank), 4096) for rank in range(world_size)}
    return {rank: [line for line in lines if line.strip()][-num_lines:] for rank, lines in tails.items()}


class AttachOnly:
    """The launcher of an attached pool: it launches nothing (the ranks run already)."""

    num_nodes = 1
    notes: list[str] = []

    def listen_address(self, runtime_dir: str, log_dir: str) -> str:
        return os.path.join(runtime_dir, "pool.sock")

    def launch(self, plan: LaunchPlan, key: bytes) -> LaunchedRanks:
        raise LaunchError("an attached pool launches no ranks")


class KeptAgent:
    """The host agent of a kept pool that another kernel started: no child of this one, so it is
    watched and ended by (pid, start time)."""

    def __init__(self, agent: tuple[int, float]) -> None:
        self._agent = agent

    def _process(self) -> psutil.Process | None:
        return reaper.running_process(self._agent)

    def is_running(self) -> bool:
        return self._process() is not None

    def process_ids(self) -> list[int]:
        return [self._agent[0]]

    def agent_exit(self) -> AgentExit | None:
        return None if self.is_running() else AgentExit("ended", pid=self._agent[0])

    def terminate(self, grace_s: float) -> None:
        process = self._process()
        if process is None:
            return
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
            process.wait(grace_s)
            return
        with contextlib.suppress(psutil.Error):
            process.kill()
            process.wait(grace_s)
