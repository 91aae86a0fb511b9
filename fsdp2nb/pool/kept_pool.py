"""What a WorkerPool does when it is kept (`--keep`): its directory, attaching from another
kernel, and letting go. A mixin of WorkerPool, kept apart so the pool's own lifecycle reads alone;
the files and records it uses are in pool/kept.py and wire/kept.py."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from fsdp2nb.errors import NoSuchPool, PoolHeldError, PoolNameTaken
from fsdp2nb.pool import kept, ray_kept, reaper
from fsdp2nb.pool.pool_log import open_pool_log
from fsdp2nb.wire.channels import STALLED_FRAME_S, KernelChannels
from fsdp2nb.wire.kept import RUN_DIR, read_activity, read_exit_reports
from fsdp2nb.wire.signing import Signer

ATTACH_TIMEOUT_S = 30.0
"""How long the ranks of a kept pool may take to reconnect to a kernel that attaches (they
reconnect at once, except a rank whose main thread runs C code that holds the GIL)."""
SAVE_IDS_PER_HOLDER_BITS = 32
"""A kernel that attaches a kept pool numbers its save requests from `serial << 32` + 1, where
`serial` is its attach record's: above every id an earlier holder sent (ranks reduce them as int64)."""


class KeptPoolParts:
    """The kept-pool methods of WorkerPool (which defines the state they use)."""

    def _make_kept_directory(self) -> None:
        """The kept pool's own directory (0700); a name in use by a live pool is refused."""
        directory = kept.kept_dir(self.keep.name)
        if directory.exists():
            meta = kept.KeptMeta.read(directory)
            if meta is not None and kept.agent_alive(meta):
                raise PoolNameTaken(f"a kept pool named {self.keep.name!r} exists already; "
                                    f"`%fsdp2 attach {self.keep.name}` uses it, or pick another --name")
            if meta is None and time.time() - directory.stat().st_mtime < 60:
                raise PoolNameTaken(f"a kept pool named {self.keep.name!r} is being started; pick another --name")
            shutil.rmtree(directory, ignore_errors=True)  # left by a pool whose agent died
        directory.mkdir(mode=0o700)
        self._kept_dir = directory
        self._runtime_dir = str(directory / RUN_DIR)
        os.mkdir(self._runtime_dir, mode=0o700)

    def _write_kept_meta(self) -> None:
        agent = reaper.process_key(self._launched.process_ids()[0])
        if agent is None:
            return  # it ended already: the start fails on that
        placement = asdict(self.spec.placement) if self.spec.placement is not None else None
        listen = ray_kept.listen_host(self._channels.address) if placement else ""
        kept.KeptMeta(name=self.keep.name, pool_id=self.pool_id, devices=self.spec.devices,
                      collective_timeout_s=self.spec.collective_timeout_s, keep_for_s=self.keep.keep_for_s,
                      agent=agent, log_dir=self.log_dir, runtime_dir=self._runtime_dir,
                      created=time.time(), placement=placement, listen=listen).write(self._kept_dir)

    @classmethod
    def attach(cls, name: str, *, take: bool = False, timeout_s: float = ATTACH_TIMEOUT_S,
               stalled_frame_s: float = STALLED_FRAME_S) -> KeptPoolParts:
        """This kernel takes the kept pool `name` (see pool/kept.py); a UsageMistake (NoSuchPool,
        PoolHeldError, ...: one line each) when it cannot, with nothing changed."""
        directory = kept.kept_dir(name)
        meta = kept.KeptMeta.read(directory) if directory.exists() else None
        if meta is None:
            names = [pool.name for pool in kept.list_pools()]
            raise NoSuchPool(f"no kept pool is named {name!r}; " + (
                f"kept pools: {', '.join(names)}" if names else "there are none (`%fsdp2 pools` lists them)"))
        if not kept.agent_alive(meta):
            shutil.rmtree(directory, ignore_errors=True)
            raise NoSuchPool(f"kept pool {name!r} is gone: its host agent (pid {meta.agent[0]}) ended; "
                             f"its logs are in {meta.log_dir}")
        pool = cls(meta.spec, launcher=kept.AttachOnly(), stalled_frame_s=stalled_frame_s,
                   keep=kept.KeepOptions(name=name, keep_for_s=meta.keep_for_s))
        pool._take(directory, meta, take, timeout_s)
        return pool

    def _take(self, directory: Path, meta: kept.KeptMeta, take: bool, timeout_s: float) -> None:
        key = kept.read_key(directory)
        signer = Signer(key)
        kept.check_wire_version(directory, signer, meta)
        current = kept.held_here(directory, signer)
        if kept.holder_alive(current) and not take:
            raise PoolHeldError(f"pool {meta.name!r} is held by {kept.describe_holder(current)}; "
                                f"`%fsdp2 attach {meta.name} --take` moves it to this kernel")
        self.pool_id, self.log_dir, self._kept_dir = meta.pool_id, meta.log_dir, directory
        self._runtime_dir = meta.runtime_dir
        self.state = "starting"
        try:
            self._socket_dir = tempfile.mkdtemp(prefix="fsdp2nb-")
            self._log = open_pool_log(os.path.join(self.log_dir, "pool.log"))
            self._signer = Signer(key, log=self._log)
            address, certificate = os.path.join(self._socket_dir, "pool.sock"), None
            if meta.listen:  # across hosts: TCP with the pool's certificate, the driver for an agent
                address, certificate = ray_kept.attach_endpoint(meta.listen, meta.runtime_dir)
            self._channels = KernelChannels(self._signer, address, log=self._log, certificate=certificate,
                                            stalled_frame_s=self._stalled_frame_s, on_stalled=self._report_stalled,
                                            on_agent_lost=self._agent_lost)
            self._launched = (ray_kept.KeptRayDriver if meta.listen else kept.KeptAgent)(meta.agent)
            self._receiver = threading.Thread(target=self._receive_loop, daemon=True, name="fsdp2nb-receiver")
            self._receiver.start()
            record = kept.hold(directory, self._signer, self._channels.address, take=take, name=meta.name)
            # The ranks remember the highest save request id they were sent (checkpoint/requests.py):
            # ids counted from 1 again would read as served already, and the dashboard's Save
            # would report the previous holder's step. Each holder's serial is higher than the last.
            self._save_request_ids = itertools.count((record.serial << SAVE_IDS_PER_HOLDER_BITS) + 1)
            # Read before the ranks wake: a rank running now either replies to this kernel or
            # holds its reply for it (RankReady.held_reply), so no run's end is missed.
            self.work_at_attach = read_activity(str(directory))
            died = read_exit_reports(str(directory), self._signer)
            self._ranks_to_join = self.world_size - len(died)
            kept.wake_agent(meta)
            self._wait_until_ready(timeout_s)
        except BaseException:
            if self._signer is not None and self._channels is not None:
                kept.let_go(directory, self._signer)
            self.release()
            raise
        self.state = "ready"
        if died:
            self.exited.update(died)
            self.mark_broken(kept.describe_deaths(died.values()) + " while no kernel held the pool")

    @property
    def kept_directory(self) -> Path | None:
        """A kept pool's directory (pool/kept.py); None for any other."""
        return self._kept_dir

    def held_here(self) -> bool:
        """Whether this kernel still holds its kept pool (always, for a pool that is not kept)."""
        if self._kept_dir is None or self._signer is None:
            return True
        return kept.held_here(self._kept_dir, self._signer) is None

    def holder_note(self) -> str:
        """Who took this kernel's kept pool, for the line that says so."""
        record = kept.held_here(self._kept_dir, self._signer) if self._kept_dir and self._signer else None
        return kept.describe_holder(record) if record is not None and record.holder_pid else "another kernel"

    def note_background_run(self, cell_id: int, execution_count: int | None, name: str | None) -> None:
        """A kept pool keeps what names a background run, for a kernel that takes it over."""
        if self._kept_dir is not None:
            kept.note_run(self._kept_dir, cell_id, kept.NotedRun(execution_count=execution_count, name=name,
                                                                 kernel_pid=os.getpid(), started=time.time()))

    def detach(self) -> None:
        """Let go of a kept pool: its ranks keep running and wait for the next kernel."""
        if self._kept_dir is not None and self._signer is not None and kept.let_go(self._kept_dir, self._signer):
            meta = kept.KeptMeta.read(self._kept_dir)
            if meta is not None:
                kept.wake_agent(meta)
        self.release()
