"""The kernel's handle on a pool of ranks: start (or attach a kept one), send requests, stop.

How the ranks come up and join is pool/rank_start.py's; the ranks' events are read as they
arrive, by the thread waiting for them or else a receiving thread (pool/event_reader.py), and
sorted (pool/rank_events.py); a kept pool's directory is its `KeptHold` (pool/kept/hold.py); the
ranks as processes of this host are pool/rank_processes.py's. The notebook side uses what
pool/handle.py declares.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from fsdp2nb.errors import LaunchError, PoolStartError
from fsdp2nb.host import memory_store
from fsdp2nb.host.process_identity import own_process_key, process_key
from fsdp2nb.pool import reaper
from fsdp2nb.pool.busy_ranks import BusyRanks
from fsdp2nb.pool.event_reader import EventReader
from fsdp2nb.pool.handle import BusyListener, PoolState, SnapshotListener
from fsdp2nb.pool.kept import holder, on_ray
from fsdp2nb.pool.kept.directory import RankWork
from fsdp2nb.pool.kept.hold import ATTACH_TIMEOUT_S, KeptHold, first_save_request_id
from fsdp2nb.pool.kept.holder import KeepOptions
from fsdp2nb.pool.launcher import AgentExit, LaunchedRanks, Launcher, describe_agent_exit, launch_plan
from fsdp2nb.pool.pool_log import close_pool_log, open_pool_log
from fsdp2nb.pool.rank_events import RankEvents
from fsdp2nb.pool.rank_processes import end_leftover_ranks, rank_process_state
from fsdp2nb.pool.rank_start import DEFAULT_START_TIMEOUT_S, launcher_for, pool_certificate, wait_until_joined
from fsdp2nb.pool.spec import PoolSpec
from fsdp2nb.wire.channels import STALLED_FRAME_S, KernelChannels, peer_name
from fsdp2nb.wire.events import EventMessage, RankExited, StreamOutput
from fsdp2nb.wire.requests import FOR_CONTROL_THREAD, ControlMessage, RequestSave, Shutdown
from fsdp2nb.wire.signing import KEY_BYTES, Signer
from fsdp2nb.wire.tls import PoolCertificate

logger = logging.getLogger(__name__)


class WorkerPool:
    """N ranks forming one torch.distributed job, owned by the notebook kernel (a PoolHandle)."""

    def __init__(self, spec: PoolSpec, launcher: Launcher | None = None, *,
                 stalled_frame_s: float = STALLED_FRAME_S, keep: KeepOptions | None = None,
                 memory_dir: str = "") -> None:
        self.spec = spec
        self.keep = keep
        """Set for a kept pool: it outlives this kernel (pool/kept/holder.py)."""
        self.memory_dir = str(memory_store.kept_store(keep.name)) if keep is not None else memory_dir
        """The snapshot store of its Checkpointers (host/memory_store.py): the session's, which
        outlives its pools; a kept pool's own. Empty: none."""
        self.pool_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.state: PoolState = "stopped"
        self._events = RankEvents(spec.world_size, self._rank_exited)
        self.ranks, self.snapshots, self.exited = self._events.ranks, self._events.snapshots, self._events.exited
        self.held_output = self._events.held_output  # the reading thread's records, shared
        self._busy = BusyRanks()
        self.broken_reason: str | None = None
        """Why the pool can run no more cells, besides a rank's exit (a dead host agent, a
        collective that timed out)."""
        self.agent_died = False
        self.log_dir = ""
        self._launcher = launcher or launcher_for(spec)
        self._channels: KernelChannels | None = None
        self._launched: LaunchedRanks | None = None
        self._reader: EventReader | None = None
        self._runtime_dir = ""
        self._save_request_ids = itertools.count(1)  # atomic: clicks arrive on any thread
        self._socket_dir = ""
        """Where this kernel's socket lives: the runtime directory, except for a kept pool, whose
        runtime directory (the process group's store) outlives every kernel."""
        self._kept: KeptHold | None = None
        """A kept pool's directory, once made or opened (pool/kept/hold.py)."""
        self._signer: Signer | None = None
        self._stalled_frame_s = stalled_frame_s
        self._log: logging.Logger | None = None
        """This pool's own log (pool.log in `log_dir`): what its connections went through."""
        self._lost_agents: dict[int, str] = {}
        """Node -> host address of agents whose connection ended (pools across hosts)."""
        self._last_cell_ids: dict[int, int] = {}
        """Per rank, the request id it was last sent (a stalled rank is reported to that cell)."""
        self.work_at_attach: list[RankWork] = []
        """A kept pool attached: what each rank ran then (its activity board); else empty."""
        self._reaper_notes: list[str] = []
        """What the reaper had to say at the start (a wait for a dead kernel's ranks)."""

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def snapshot_listeners(self) -> list[SnapshotListener]:
        """Called on the reading thread with every snapshot and every progress event."""
        return self._events.listeners

    @snapshot_listeners.setter
    def snapshot_listeners(self, listeners: list[SnapshotListener]) -> None:
        self._events.listeners = listeners

    @property
    def busy_listeners(self) -> list[BusyListener]:
        """Called when a request starts or ends (`mark_busy`, `mark_idle`), on the thread that marks it."""
        return self._busy.listeners

    @busy_listeners.setter
    def busy_listeners(self, listeners: list[BusyListener]) -> None:
        self._busy.listeners = listeners

    @property
    def busy_ranks(self) -> frozenset[int]:
        """Ranks running a request from this kernel: a cell, or a background run."""
        return self._busy.ranks

    @property
    def busy_since(self) -> dict[int, float]:
        return self._busy.since

    def mark_busy(self, ranks: tuple[int, ...], since: dict[int, float] | None = None) -> None:
        """Called before a request is sent (a Save or Stop click meanwhile sees it running)."""
        self._busy.mark(ranks, since)

    def mark_idle(self, ranks: tuple[int, ...]) -> None:
        self._busy.clear(ranks)

    def mark_broken(self, reason: str) -> None:
        """The pool can run no more cells (its process group is unusable); `reason` says why."""
        self.state = "broken"
        self.broken_reason = reason

    def wait_for_exit_cause(self, grace_s: float) -> bool:
        """After a rank could not be reached: wait up to `grace_s` for what ended it to be
        known (its host agent's exit, or the agent's report of the rank's exit). A rank that
        ends at once after it took a request breaks its connection before the agent's exit
        can be seen; the cause, not the broken pipe, is what the cell must name."""
        deadline = time.monotonic() + grace_s
        while self.check_agent() and not self.exited:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)  # the receiving thread records the agent's report meanwhile
        return True

    @property
    def start_notes(self) -> list[str]:
        """What the cell that starts the pool should say besides (e.g. a warning about Ray's security)."""
        return list(self._launcher.notes) + self._reaper_notes

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Start the ranks and return once every one has joined the process group."""
        reaper.reap_orphans(spare_store=self.memory_dir, notes=self._reaper_notes)
        self.state = "starting"
        try:
            key = secrets.token_bytes(KEY_BYTES)
            self._make_directories()
            log = self._log = open_pool_log(os.path.join(self.log_dir, "pool.log"))
            address = self._launcher.listen_address(self._socket_dir, self.log_dir)
            certificate = pool_certificate(address, self._runtime_dir)
            signer, channels = self._listen(key, address, certificate, log)
            if self._kept is not None:
                self._kept.hold_new(key, signer, channels.address, self.world_size)
            plan = launch_plan(self.spec, pool_id=self.pool_id, address=channels.address,
                               runtime_dir=self._runtime_dir, log_dir=self.log_dir,
                               tls_fingerprint=certificate.fingerprint if certificate else "",
                               kept_dir=str(self._kept.directory) if self._kept else "",
                               keep_for_s=self.keep.keep_for_s if self.keep else None,
                               memory_dir=self.memory_dir)
            launched = self._launched = self._launcher.launch(plan, key)
            self._register(launched, channels.address)
            self._wait_until_ready(timeout_s)
            self._register(launched, channels.address)
        except LaunchError as error:
            self.stop(polite=False)
            raise PoolStartError(str(error)) from None
        except BaseException:
            self.stop(polite=False)
            raise
        self.state = "ready"

    def _listen(self, key: bytes, address: str, certificate: PoolCertificate | None,
                log: logging.Logger) -> tuple[Signer, KernelChannels]:
        """Listen for the ranks at `address`, signing with `key`, and start reading their events."""
        signer = self._signer = Signer(key, log=log)
        channels = self._channels = KernelChannels(
            signer, address, log=log, certificate=certificate, stalled_frame_s=self._stalled_frame_s,
            on_stalled=self._report_stalled, on_agent_lost=self._agent_lost)
        self._reader = EventReader(channels, self._events)
        return signer, channels

    def _make_directories(self) -> None:
        self._socket_dir = tempfile.mkdtemp(prefix="fsdp2nb-")  # mkdtemp makes it 0700
        self._runtime_dir = self._socket_dir
        if self.keep is not None:
            self._kept = KeptHold.create(self.keep)
            self._runtime_dir = self._kept.runtime_dir
            memory_store.mark_owner(Path(self.memory_dir), self._kept.directory)
        self.log_dir = str(reaper.state_dir() / "logs" / self.pool_id)
        os.makedirs(self.log_dir, mode=0o700, exist_ok=True)

    def _wait_until_ready(self, timeout_s: float) -> None:
        assert self._channels is not None and self._launched is not None, "listening, and the ranks launched"
        wait_until_joined(self.spec, self._events, self._channels, self._launched, timeout_s=timeout_s,
                          log_dir=self.log_dir, lost_agents=self._lost_agents)

    def _register(self, launched: LaunchedRanks, address: str) -> None:
        if self._kept is not None:  # no reaper: a kept pool outlives its kernel on purpose
            self._write_kept_meta(self._kept, launched, address)
            return
        processes = [process_key(pid) for pid in launched.process_ids()]
        processes += [(info.pid, info.start_time) for info in self.ranks.values() if not info.address]
        reaper.record_pool(self.pool_id, own_process_key(), [p for p in processes if p],
                           runtime_dir=self._runtime_dir)

    # --- kept pools (the directory's part is KeptHold's) ------------------------------------

    def _write_kept_meta(self, hold: KeptHold, launched: LaunchedRanks, address: str) -> None:
        agent = process_key(launched.process_ids()[0])
        if agent is None:
            return  # it ended already: the start fails on that
        listen = on_ray.listen_host(address) if self.spec.placement is not None else ""
        hold.write_meta(spec=self.spec, pool_id=self.pool_id, agent=agent, log_dir=self.log_dir, listen=listen)

    @classmethod
    def attach(cls, name: str, *, take: bool = False, timeout_s: float = ATTACH_TIMEOUT_S,
               stalled_frame_s: float = STALLED_FRAME_S) -> WorkerPool:
        """This kernel takes the kept pool `name` (see pool/kept/holder.py); a UsageMistake (NoSuchPool,
        PoolHeldError, ...: one line each) when it cannot, with nothing changed."""
        hold, meta = KeptHold.open(name)
        key = hold.key_to_take(meta, take)
        pool = cls(meta.spec, launcher=holder.AttachOnly(), stalled_frame_s=stalled_frame_s, keep=hold.keep)
        pool._attach(hold, meta, key, take, timeout_s)
        return pool

    def _attach(self, hold: KeptHold, meta: holder.KeptMeta, key: bytes, take: bool, timeout_s: float) -> None:
        self._kept, self.pool_id, self.log_dir, self._runtime_dir = hold, meta.pool_id, meta.log_dir, meta.runtime_dir
        self.state = "starting"
        try:
            self._socket_dir = tempfile.mkdtemp(prefix="fsdp2nb-")
            log = self._log = open_pool_log(os.path.join(self.log_dir, "pool.log"))
            address, certificate = os.path.join(self._socket_dir, "pool.sock"), None
            if meta.listen:  # across hosts: TCP with the pool's certificate, the driver for an agent
                address, certificate = on_ray.attach_endpoint(meta.listen, meta.runtime_dir)
            signer, channels = self._listen(key, address, certificate, log)
            self._launched = (on_ray.KeptRayDriver if meta.listen else holder.KeptAgent)(meta.agent)
            record = hold.hold(signer, channels.address, take=take)
            self._save_request_ids = itertools.count(first_save_request_id(record))
            self.work_at_attach, died = hold.ranks_at_attach()
            self._events.ranks_to_join = self.world_size - len(died)
            holder.wake_agent(meta)
            self._wait_until_ready(timeout_s)
        except BaseException:
            hold.let_go()
            self.release()
            raise
        self.state = "ready"
        if died:
            self.exited.update(died)
            self.mark_broken(holder.describe_deaths(died.values()) + " while no kernel held the pool")

    def held_here(self) -> bool:
        """Whether this kernel still holds its kept pool (always, for a pool that is not kept)."""
        return self._kept is None or self._kept.held_here()

    def holder_note(self) -> str:
        """Who took this kernel's kept pool, for the line that says so."""
        return self._kept.holder_note() if self._kept is not None else "another kernel"

    def note_background_run(self, cell_id: int, execution_count: int | None, name: str | None) -> None:
        """A kept pool keeps what names a background run, for a kernel that takes it over."""
        if self._kept is not None:
            self._kept.note_run(cell_id, execution_count, name)

    def noted_background_run(self, cell_id: int) -> holder.NotedRun | None:
        """What the kernel that started the background run `cell_id` of a kept pool noted of it."""
        return self._kept.noted_run(cell_id) if self._kept is not None else None

    def detach(self) -> None:
        """Let go of a kept pool: its ranks keep running and wait for the next kernel."""
        if self._kept is not None:
            self._kept.detach()
        self.release()

    def release(self) -> None:
        """Close this kernel's end without ending the ranks (a kept pool); safe to call twice."""
        if self._reader is not None:
            self._reader.stop()
        if self._channels is not None:
            self._channels.close()
        self._channels = None
        if self._log is not None:
            close_pool_log(self._log)
        self._log = None
        if self._socket_dir and self._socket_dir != self._runtime_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self.state = "stopped"

    def stop(self, *, polite: bool = True, grace_s: float = 30.0, keep_memory: bool = False) -> None:
        """End every rank and release every resource; safe to call twice.

        Polite: ask each idle rank to exit and give them `grace_s` (an asynchronous checkpoint
        save finishes first); ranks still there are then terminated. `polite=False` is for
        ranks known to be stuck. A kept pool that another kernel took is only let go of.
        `keep_memory`: a kept pool's snapshots stay for the pool that replaces it (a restart).
        """
        if self.state == "stopped" and self._channels is None:
            return
        if not self.held_here():
            self.release()
            return
        if polite and self._launched is not None:
            self._ask_ranks_to_exit(self._launched, grace_s)
        if self._launched is not None:
            self._launched.terminate(grace_s=3.0)
        end_leftover_ranks(self.ranks.values())
        self.release()
        shutil.rmtree(self._runtime_dir, ignore_errors=True)
        if self._kept is not None:
            self._kept.remove()
            if not keep_memory:
                memory_store.remove_store(self.memory_dir)
        reaper.forget_pool(self.pool_id)
        self.state = "stopped"

    def check_agent(self) -> bool:
        """Whether the host agent runs; if it ended unasked, the pool is broken: its ranks die with it."""
        if self.agent_died:
            return False
        if self._launched is None or self.state not in ("ready", "broken"):
            return True
        ended = self._launched.agent_exit()
        if ended is None:
            return True
        self.agent_died = True
        self.state = "broken"
        self.broken_reason = f"{self._agent_exit_text(ended)}; its ranks ended with it"
        return False

    def _agent_exit_text(self, ended: AgentExit) -> str:
        return describe_agent_exit(ended, self._lost_agents, len(self.spec.devices))

    def _agent_lost(self, node: int, host: str) -> None:
        """Called on the reading thread when an agent's connection ended."""
        if self.state in ("ready", "starting"):
            self._lost_agents.setdefault(node, host)

    def rank_process_state(self, rank: int) -> str:
        """A rank process's state as the OS reports it (see pool/rank_processes.py)."""
        return rank_process_state(self.ranks.get(rank))

    def _ask_ranks_to_exit(self, launched: LaunchedRanks, grace_s: float) -> None:
        for rank in self.ranks:
            if rank not in self.exited:
                try:
                    self.send(rank, Shutdown(), connect_timeout_s=0)
                except ConnectionError:
                    pass
        deadline = time.monotonic() + grace_s
        while launched.is_running() and time.monotonic() < deadline:
            time.sleep(0.02)

    # --- messages -----------------------------------------------------------------------------

    def send(self, ranks: int | tuple[int, ...], message: ControlMessage, connect_timeout_s: float = 5.0) -> None:
        """Send `message` to one rank or to several."""
        assert self._channels is not None, "the pool is not running"
        control = isinstance(message, FOR_CONTROL_THREAD)
        cell_id = getattr(message, "cell_id", None)
        if cell_id is not None:
            for rank in (ranks,) if isinstance(ranks, int) else ranks:
                self._last_cell_ids[rank] = cell_id
        self._channels.send(ranks, message, control=control, connect_timeout_s=connect_timeout_s)

    def request_save(self) -> int:
        """Ask every rank to save at its next `maybe_save`; works while a cell runs. Returns the id."""
        request_id = self.new_save_request_id()
        self.send(tuple(range(self.world_size)), RequestSave(request_id=request_id), connect_timeout_s=0)
        return request_id

    def new_save_request_id(self) -> int:
        """A fresh id for a save request, higher than any before on this pool's ranks (a kept
        pool's too: each kernel that attaches counts on from above the ids of the ones before)."""
        return next(self._save_request_ids)

    def next_event(self, timeout_s: float) -> EventMessage | None:
        """The next event for a waiting request, in arrival order; None after `timeout_s`."""
        if self._reader is None:
            return self._events.next_event(timeout_s)
        return self._reader.next_event(timeout_s)

    def _report_stalled(self, rank: int | None, stalled_s: float) -> None:
        """Say in the cell that waits on `rank` (or the next one) that it stopped mid-message."""
        if rank is None:
            return  # the host agent sends no cell's output: pool.log has the line
        pid = self.ranks[rank].pid if rank in self.ranks else "PID"
        text = (f"fsdp2nb: {peer_name(rank)} stopped in the middle of sending a message {stalled_s:.0f} s ago "
                "(stopped by a signal or a debugger?); the other ranks go on. Resume it "
                f"(kill -CONT {pid}) or interrupt the cell to restart the pool.\n")
        cell_id = self._last_cell_ids.get(rank) if rank in self.busy_ranks else None
        self._events.sort(StreamOutput(rank=rank, cell_id=cell_id, stream="stderr", text=text))

    def _rank_exited(self, event: RankExited) -> None:
        if self.state != "stopped":
            self.state = "broken"

