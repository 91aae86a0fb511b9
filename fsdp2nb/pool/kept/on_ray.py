"""A kept pool on Ray hosts (`%fsdp2 start --ray ... --keep`): what differs from one kept on this host.

The pool's directory stays on the kernel's host (pool/kept/holder.py), but its agents and ranks run
elsewhere and cannot read it, nor watch the holding kernel's pid. The Ray driver, which the
kernel starts in a session of its own and which outlives it for a kept pool, bridges the two:

- at launch, each actor makes its host's directory (`node-N/`, 0700) with a copy of the attach
  record and an activity board for its ranks, before it starts the agent;
- `KeptWatch` (in the driver) watches the holding kernel's pid; when it ends, or when a kernel
  that attached sends SIGUSR1, it copies this host's activity boards in (what `%fsdp2 pools` and
  the attaching kernel read: the running request, the last cell id) and the signed record out to
  every host, whose agent follows it as on one host (pool/kept/keeper.py);
- the pool ends with the driver: on `%fsdp2 stop` (`{"stop"}` from the kernel that started it,
  SIGTERM from one that attached), or when an agent ends (`--keep-for` ran out).

A kernel that attaches listens on the same cluster address as the first, on a fresh port, with
the pool's certificate (kept 0600 in the pool's runtime directory): the ranks check the
fingerprint they were launched with.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import sys
import time
from pathlib import Path

from fsdp2nb.atomic_files import replace_atomically
from fsdp2nb.errors import UnsafeDirectory
from fsdp2nb.host.pid_watch import PidWatch
from fsdp2nb.pool.kept import holder
from fsdp2nb.pool.kept.directory import (
    ACTIVITY_FILE,
    META_FILE,
    RECORD_FILE,
    SLOT_BYTES,
    create_activity_board,
    decode_attach_record,
    host_kept_dir,
    write_attach_record,
)
from fsdp2nb.pool.launcher import DEFAULT_GRACE_S
from fsdp2nb.wire.endpoints import split_tcp_address, tcp_address
from fsdp2nb.wire.launch_plan import LaunchPlan
from fsdp2nb.wire.protocol import AttachRecord
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.tls import PoolCertificate, load_pool_certificate

ACTOR_CALL_S = 30.0
"""How long the driver waits for the actors to hand over a record (a lost host's never answers)."""
DRIVER_STOP_S = 60.0
"""How long a kernel that attached waits for the driver to end the pool (its actors, the
placement group) before it kills it; Ray then frees them as it does for any ended job."""


# --- the kernel's side ------------------------------------------------------------------------


def listen_host(address: str) -> str:
    """The host part of the kernel's TCP address, where kernels that attach listen too."""
    return split_tcp_address(address)[0]


def attach_endpoint(listen: str, runtime_dir: str) -> tuple[str, PoolCertificate]:
    """Where a kernel that attaches listens (a fresh port), and the certificate it shows."""
    return tcp_address(listen, 0), load_pool_certificate(runtime_dir)


class KeptRayDriver(holder.KeptAgent):
    """The Ray driver of a kept pool, seen from a kernel that attached: ending it ends the pool."""

    def terminate(self, grace_s: float) -> None:
        super().terminate(grace_s + DRIVER_STOP_S)


# --- the actors' side (on each host) ------------------------------------------------------------


def prepare_host_dir(request: str, node: int, record: bytes) -> str:
    """This host's directory of a kept pool, with the attach record and an idle activity board."""
    plan, _ = LaunchPlan.decode(request.encode())
    directory = host_kept_dir(plan.kept_dir, node, multi_host=True)
    _make_private_dirs(directory)
    write_private(os.path.join(directory, RECORD_FILE), record)
    create_activity_board(directory, plan.world_size)
    return directory


def _make_private_dirs(path: str) -> None:
    """Make `path` (`<state dir>/kept/NAME/node-N`) and any missing parent 0700 (makedirs would
    give parents the umask's mode); each of the four must be this user's own directory."""
    missing, parent = [], path
    while not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        os.mkdir(directory, 0o700)
    for _ in range(4):
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise UnsafeDirectory(f"{path} is not a directory of this user's: refusing to keep a pool's files there")
        os.chmod(path, 0o700)
        path = os.path.dirname(path)


def write_private(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically, readable by this user only."""
    replace_atomically(path, data, private=True)


# --- the driver's side --------------------------------------------------------------------------


class KeptWatch:
    """The driver of a kept pool after launch: follows holders, and returns when the pool must end."""

    def __init__(self, driver, plan: LaunchPlan, key: bytes) -> None:  # ray_driver.Driver
        self._driver = driver
        self._plan = plan
        self._directory = Path(plan.kept_dir)
        self._signer = Signer(key)
        self._serial = 0
        self._holder: AttachRecord | None = None
        self._poller = select.poll()
        self._holder_watch = PidWatch(self._poller)
        self._flags: set[str] = set()
        self._signals = self._wake_on_signals()
        self._agent_ended, ended_write = os.pipe()
        driver.on_agent_exit = lambda: os.write(ended_write, b"x")
        for fd in (self._signals, self._agent_ended, sys.stdin.fileno()):
            self._poller.register(fd, select.POLLIN)

    def _wake_on_signals(self) -> int:
        """SIGUSR1 (a kernel attached) and SIGTERM (stop) set a flag and wake `run`."""
        read_end, write_end = os.pipe()
        for fd in (read_end, write_end):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        signal.signal(signal.SIGUSR1, lambda signum, frame: self._flags.add("attach"))
        signal.signal(signal.SIGTERM, lambda signum, frame: self._flags.add("stop"))
        return read_end

    def record_bytes(self) -> bytes:
        """The record the starting kernel wrote (it holds the pool), for every host's directory."""
        raw = (self._directory / RECORD_FILE).read_bytes()
        record = decode_attach_record(self._signer, raw)
        assert isinstance(record, AttachRecord), "the kernel writes the record before it launches"
        self._serial = record.serial
        self._watch_holder(record)
        return raw

    def run(self) -> float:
        """Serve until the pool must end; returns the agents' grace for their ranks."""
        while True:
            ready = {fd for fd, _ in self._poller.poll()}
            _drain(self._signals)
            if sys.stdin.fileno() in ready:
                message = self._read_kernel_line()
                if message is not None and "stop" in message:
                    return float(message["stop"])
            if self._agent_ended in ready:
                print("fsdp2nb driver: an agent ended; ending the kept pool", file=sys.stderr, flush=True)
                return DEFAULT_GRACE_S
            if "stop" in self._flags:
                return DEFAULT_GRACE_S
            if self._holder_watch.fd in ready:
                self._holder_ended()
            if "attach" in self._flags:
                self._flags.discard("attach")
                self._follow()

    def _read_kernel_line(self) -> dict | None:
        """A message of the kernel that started the pool; None once it is gone (the pool stays)."""
        line = sys.stdin.readline()
        if line:
            return json.loads(line)
        self._poller.unregister(sys.stdin.fileno())
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # reports go to the log, not into a closed pipe
        return None

    def _watch_holder(self, record: AttachRecord | None) -> None:
        """Wake when the kernel that `record` names ends (None, or no kernel: stop watching)."""
        self._holder_watch.close()
        self._holder = record if record is not None and record.holder_pid else None
        if self._holder is None:
            return
        if not holder.holder_alive(self._holder) or not self._holder_watch.watch(self._holder.holder_pid):
            self._holder_ended()  # it ended before it could be watched

    def _holder_ended(self) -> None:
        """The holding kernel is gone: write that no kernel holds the pool (unless another took
        it meanwhile), and tell every host."""
        ended = self._holder
        if ended is None:
            return  # no kernel was watched
        self._watch_holder(None)
        print(f"fsdp2nb driver: kernel {ended.holder_pid} is gone; the pool keeps running", file=sys.stderr, flush=True)
        try:
            with holder.holder_lock(self._directory):
                current = holder.read_attach_record(str(self._directory), self._signer)
                if current is not None and current.holder_pid == ended.holder_pid:
                    write_attach_record(str(self._directory), self._signer, AttachRecord(
                        serial=current.serial + 1, address="", holder_pid=0, holder_start_time=0.0,
                        since=time.time()))
        except OSError as error:  # the directory was removed: the pool is being stopped
            print(f"fsdp2nb driver: could not note the kernel's end: {error}", file=sys.stderr, flush=True)
            return
        self._follow()

    def _follow(self) -> None:
        """Pass a newer record on to every host, having copied their activity boards here first
        (the kernel that attaches reads them once the ranks have reconnected)."""
        try:
            raw = (self._directory / RECORD_FILE).read_bytes()
        except OSError:  # the directory was removed: the pool is being stopped
            return
        record = decode_attach_record(self._signer, raw)
        if not isinstance(record, AttachRecord) or record.serial <= self._serial:
            return
        self._serial = record.serial
        ray, actors = self._driver.ray, self._driver.actors
        try:
            self._gather_activity(ray.get([actor.activity.remote() for actor in actors], timeout=ACTOR_CALL_S))
            ray.get([actor.follow.remote(raw) for actor in actors], timeout=ACTOR_CALL_S)
        except Exception as error:  # an actor is gone: its exit ends the pool
            print(f"fsdp2nb driver: could not reach every host: {error}", file=sys.stderr, flush=True)
        self._watch_holder(record)

    def _gather_activity(self, boards: list[bytes]) -> None:
        """One board for the pool: each host's slots for its own ranks."""
        per_node = len(self._plan.ranks_of_node(0)) * SLOT_BYTES
        parts = [board[node * per_node:(node + 1) * per_node] for node, board in enumerate(boards)]
        if all(len(part) == per_node for part in parts):
            write_private(str(self._directory / ACTIVITY_FILE), b"".join(parts))

    def remove_directory(self) -> None:
        """The pool's directory goes with it, unless a new pool took its name."""
        try:
            if json.loads((self._directory / META_FILE).read_text()).get("pool_id") != self._plan.pool_id:
                return
        except (OSError, ValueError):
            pass
        shutil.rmtree(self._directory, ignore_errors=True)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass

