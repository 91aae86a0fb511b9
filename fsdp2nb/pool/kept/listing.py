"""`%fsdp2 pools`: this user's kept pools on this host, one line each, read from their directories
(pool/kept/holder.py) without holding any; the directory of a pool whose agent is gone is removed."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp2nb.pool.kept.directory import (
    RankWork,
    read_activity,
    read_attach_envelope,
    read_attach_record,
    read_exit_reports,
)
from fsdp2nb.pool.kept.holder import (
    KeptMeta,
    agent_alive,
    describe_deaths,
    describe_ranks,
    holder_alive,
    kept_root,
    read_key,
)
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.versions import WireVersion, ours


@dataclass(frozen=True, slots=True)
class KeptPool:
    """One line of `%fsdp2 pools`: a kept pool of this user on this host."""

    name: str
    spec: str
    """The options that describe its ranks and devices, e.g. `--cpu 2`."""
    holder_pid: int | None
    """The kernel that holds it; None while detached."""
    since: float
    """Held since, or detached since (time.time())."""
    run: str | None
    """What its ranks run now, e.g. "In[7] running on ranks 0-1 for 42s"; None when idle."""
    keep_for_s: float | None
    seconds_left: float | None
    """Until it ends itself (only while detached and idle)."""
    log_dir: str
    died: str | None = None
    """Ranks that died while no kernel held the pool, e.g. "rank 1 died (exit code 3)"."""
    wire: WireVersion | None = None
    """The wire version it speaks where that is not this kernel's (it cannot be attached here)."""

    def __str__(self) -> str:
        if self.wire is not None:
            return (f"{self.name}: {self.spec}, speaks {self.wire.describe(ours())}, this kernel "
                    f"{ours().describe(self.wire)}: it cannot be attached here")
        when = time.strftime("%H:%M:%S", time.localtime(self.since))
        held = f"held by kernel {self.holder_pid} (since {when})" if self.holder_pid else f"detached (since {when})"
        if self.died:
            restart = "`%fsdp2 restart` there" if self.holder_pid else f"`%fsdp2 attach {self.name}`, then `%fsdp2 restart`"
            held += f", {self.died} ({restart} starts its ranks afresh)"
        if self.keep_for_s is None:
            clock = "kept until `%fsdp2 stop`"
        elif self.seconds_left is not None:
            clock = f"ends in {describe_duration(self.seconds_left)} (--keep-for {describe_duration(self.keep_for_s)})"
        else:
            clock = f"--keep-for {describe_duration(self.keep_for_s)} once detached and idle"
        return f"{self.name}: {self.spec}, {held}, {self.run or 'idle'}, {clock}"


class KeptPools(list):
    """What `%fsdp2 pools` returns: the pools as data, shown as one line each."""

    def __repr__(self) -> str:
        return "\n".join(map(str, self)) if self else "no kept pools"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython's pretty printer
        printer.text(repr(self))


def list_pools() -> KeptPools:
    """This user's kept pools on this host; the directory of one whose agent is gone is removed."""
    pools = KeptPools()
    for directory in sorted(kept_root().iterdir()):
        meta = KeptMeta.read(directory)
        if meta is None:
            if time.time() - _mtime(directory) > 60:  # not one being made right now
                shutil.rmtree(directory, ignore_errors=True)
            continue
        if not agent_alive(meta):
            shutil.rmtree(directory, ignore_errors=True)
            continue
        pools.append(_describe(directory, meta))
    return pools


def _describe(directory: Path, meta: KeptMeta) -> KeptPool:
    try:
        signer = Signer(read_key(directory))
    except (OSError, ValueError):
        signer = None
    opened = read_attach_envelope(str(directory), signer) if signer is not None else None
    if opened is not None and opened.message is None:  # another fsdp2nb's: its files may read otherwise
        return KeptPool(name=meta.name, spec=meta.spec.describe(), holder_pid=None, since=meta.created,
                        run=None, keep_for_s=meta.keep_for_s, seconds_left=None, log_dir=meta.log_dir,
                        wire=opened.version)
    record = read_attach_record(str(directory), signer) if signer is not None else None
    died = read_exit_reports(str(directory), signer) if signer is not None else {}
    holder = record.holder_pid if record is not None and holder_alive(record) else None
    since = record.since if record is not None else meta.created
    work = read_activity(str(directory))
    run = describe_run(work)
    left = None
    if holder is None and run is None and meta.keep_for_s is not None and work:
        left = max(since, max(slot.since for slot in work)) + meta.keep_for_s - time.time()
    return KeptPool(name=meta.name, spec=meta.spec.describe(), holder_pid=holder, since=since, run=run,
                    keep_for_s=meta.keep_for_s, seconds_left=left, log_dir=meta.log_dir,
                    died=describe_deaths(died.values()) if died else None)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def describe_run(work: list[RankWork]) -> str | None:
    running = [rank for rank, slot in enumerate(work) if slot.running_cell_id is not None]
    if not running:
        return None
    first = work[running[0]]
    what = f"In[{first.execution_count}]" if first.execution_count is not None else "a request"
    started = min(work[rank].since for rank in running)
    line = f"{what} running on {describe_ranks(running)} for {describe_duration(time.time() - started)}"
    waiting = [rank for rank in running if work[rank].waiting_for_input]
    return line + (f", {describe_ranks(waiting)} waiting for input" if waiting else "")


def describe_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 2 * 3600:
        return f"{seconds // 60}m"
    return f"{seconds / 3600:.1f}h"
