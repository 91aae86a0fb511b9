"""What makes a WorkerPool kept (`--keep`): `KeptHold`, its directory as the holding kernel uses
it. The pool holds one (pool/pool.py) and calls it at each step of its lifecycle; the files and
records it reads and writes are in pool/kept/holder.py and pool/kept/directory.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from fsdp2nb.errors import NoSuchPool, PoolHeldError, PoolNameTaken
from fsdp2nb.pool.kept import holder
from fsdp2nb.pool.kept.directory import (
    RUN_DIR,
    RankWork,
    create_activity_board,
    read_activity,
    read_exit_reports,
)
from fsdp2nb.pool.kept.holder import KeepOptions, KeptMeta
from fsdp2nb.pool.kept.listing import list_pools
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.events import RankExited
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer

ATTACH_TIMEOUT_S = 30.0
"""How long the ranks of a kept pool may take to reconnect to a kernel that attaches (they
reconnect at once, except a rank whose main thread runs C code that holds the GIL)."""
SAVE_IDS_PER_HOLDER_BITS = 32
"""A kernel that attaches a kept pool numbers its save requests from `serial << 32` + 1, where
`serial` is its attach record's: above every id an earlier holder sent (ranks reduce them as int64)."""


class KeptHold:
    """A kept pool's directory, as the kernel that starts or attaches the pool uses it: made or
    opened, held (the attach record names this kernel), noted in, let go of, removed."""

    def __init__(self, keep: KeepOptions, directory: Path) -> None:
        self.keep = keep
        self.directory = directory
        self._signer: Signer | None = None
        """Set once this kernel holds the pool (`hold_new`, `hold`)."""

    # --- a pool this kernel starts --------------------------------------------------------------

    @classmethod
    def create(cls, keep: KeepOptions) -> KeptHold:
        """The kept pool's own directory (0700) with its runtime directory in it; a name in use
        by a live pool is refused."""
        directory = holder.kept_dir(keep.name)
        if directory.exists():
            meta = KeptMeta.read(directory)
            if meta is not None and holder.agent_alive(meta):
                raise PoolNameTaken(f"a kept pool named {keep.name!r} exists already; "
                                    f"`%fsdp2 attach {keep.name}` uses it, or pick another --name")
            if meta is None and time.time() - directory.stat().st_mtime < 60:
                raise PoolNameTaken(f"a kept pool named {keep.name!r} is being started; pick another --name")
            shutil.rmtree(directory, ignore_errors=True)  # left by a pool whose agent died
        directory.mkdir(mode=0o700)
        hold = cls(keep, directory)
        os.mkdir(hold.runtime_dir, mode=0o700)
        return hold

    @property
    def runtime_dir(self) -> str:
        """Where the ranks' process group keeps its store: it outlives every kernel."""
        return str(self.directory / RUN_DIR)

    def hold_new(self, key: bytes, signer: Signer, address: str, world_size: int) -> None:
        """Before the launch: the pool's key and activity board, and this kernel as its holder."""
        holder.write_key(self.directory, key)
        create_activity_board(str(self.directory), world_size)
        self._signer = signer
        holder.hold(self.directory, signer, address, take=False, name=self.keep.name)

    def write_meta(self, *, spec: PoolSpec, pool_id: str, agent: tuple[int, float], log_dir: str,
                   listen: str) -> None:
        """`pool.json`, once the agent runs: what a kernel that attaches later starts from."""
        KeptMeta(keep=self.keep, spec=spec, pool_id=pool_id, agent=agent, log_dir=log_dir,
                 runtime_dir=self.runtime_dir, created=time.time(), listen=listen).write(self.directory)

    # --- a pool this kernel attaches -------------------------------------------------------------

    @classmethod
    def open(cls, name: str) -> tuple[KeptHold, KeptMeta]:
        """The kept pool `name` and what its `pool.json` says; NoSuchPool (one line) if there is
        none, or its agent is gone (its directory is then removed)."""
        directory = holder.kept_dir(name)
        meta = KeptMeta.read(directory) if directory.exists() else None
        if meta is None:
            names = [pool.name for pool in list_pools()]
            raise NoSuchPool(f"no kept pool is named {name!r}; " + (
                f"kept pools: {', '.join(names)}" if names else "there are none (`%fsdp2 pools` lists them)"))
        if not holder.agent_alive(meta):
            shutil.rmtree(directory, ignore_errors=True)
            raise NoSuchPool(f"kept pool {name!r} is gone: its host agent (pid {meta.agent[0]}) ended; "
                             f"its logs are in {meta.log_dir}")
        return cls(meta.keep, directory), meta

    def key_to_take(self, meta: KeptMeta, take: bool) -> bytes:
        """The pool's key, once its wire version is this kernel's and no live kernel holds it (or
        `take`); else a UsageMistake in one line, with nothing written."""
        key = holder.read_key(self.directory)
        signer = Signer(key)
        holder.check_wire_version(self.directory, signer, meta)
        current = holder.held_here(self.directory, signer)
        if current is not None and holder.holder_alive(current) and not take:
            raise PoolHeldError(f"pool {meta.name!r} is held by {holder.describe_holder(current)}; "
                                f"`%fsdp2 attach {meta.name} --take` moves it to this kernel")
        return key

    def hold(self, signer: Signer, address: str, *, take: bool) -> AttachRecord:
        """Make this kernel the holder, listening at `address` (the caller then wakes the agent)."""
        self._signer = signer
        return holder.hold(self.directory, signer, address, take=take, name=self.keep.name)

    def ranks_at_attach(self) -> tuple[list[RankWork], dict[int, RankExited]]:
        """What each rank runs (its activity slot), and the ranks that died while no kernel held
        the pool. Read before the ranks wake: a rank running now either replies to this kernel
        or holds its reply for it, so no run's end is missed."""
        assert self._signer is not None, "read once held"
        return read_activity(str(self.directory)), read_exit_reports(str(self.directory), self._signer)

    # --- while held ----------------------------------------------------------------------------

    def held_here(self) -> bool:
        """Whether this kernel still holds the pool."""
        return self._signer is None or holder.held_here(self.directory, self._signer) is None

    def holder_note(self) -> str:
        """Who took the pool from this kernel, for the line that says so."""
        record = holder.held_here(self.directory, self._signer) if self._signer is not None else None
        return holder.describe_holder(record) if record is not None and record.holder_pid else "another kernel"

    def note_run(self, cell_id: int, execution_count: int | None, name: str | None) -> None:
        """Keep what names a background run, for a kernel that takes it over."""
        holder.note_run(self.directory, cell_id, holder.NotedRun(execution_count=execution_count, name=name,
                                                             kernel_pid=os.getpid(), started=time.time()))

    def noted_run(self, cell_id: int) -> holder.NotedRun | None:
        return holder.noted_runs(self.directory).get(cell_id)

    def let_go(self) -> bool:
        """Write that no kernel holds the pool, if this kernel still does; returns whether it did."""
        return self._signer is not None and holder.let_go(self.directory, self._signer)

    def detach(self) -> None:
        """Let go, and wake the agent: its ranks keep running and wait for the next kernel."""
        if self.let_go():
            meta = KeptMeta.read(self.directory)
            if meta is not None:
                holder.wake_agent(meta)

    def remove(self) -> None:
        """The pool ended: its directory goes."""
        shutil.rmtree(self.directory, ignore_errors=True)


def first_save_request_id(record: AttachRecord) -> int:
    """The ranks remember the highest save request id they were sent (checkpoint/requests.py):
    ids counted from 1 again would read as served already, and the dashboard's Save would report
    the previous holder's step. Each holder's serial is higher than the last."""
    return (record.serial << SAVE_IDS_PER_HOLDER_BITS) + 1

