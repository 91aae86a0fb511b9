"""Process groups that survive a failed collective: released at once, re-formed in place.

A thread blocked in a gloo collective ignores SIGINT, and `ProcessGroup.abort()` does not wake
it. What does is the end of its connections: when a rank shuts down its gloo sockets, every
peer waiting on them raises "Connection closed by peer" at once. So each group of a CPU pool is
a `ReformableGlooGroup`: a `ProcessGroup` whose collectives go to an inner gloo backend that can
be replaced. `release_collectives()` (the rank's control thread, on the kernel's
`ReleaseCollectives`) shuts the inner backends' connections down; `reform_groups()` (the main
thread, once every rank's cell has ended) gives each group a fresh inner backend over the same
store, under a new prefix. The group objects stay, so the `DeviceMesh`, FSDP2's modules, DTensors
and whatever else holds a group keep working.

The release and the re-forming travel on different channels (control and main), so a busy rank
can read the release after the re-forming that follows it, and a release carried out then would
cut the fresh connections. Each release has an id, the re-forming names the one it follows and
waits for it, and a release that comes later still is dropped.

Every group made with the pool's default backend is one (`new_group()` without `backend=`,
`init_device_mesh`); a group made with `backend="gloo"` explicitly is plain gloo and cannot be
re-formed (`unreformable_groups()` names them).

A checkpointer's background group is neither released nor re-formed: only its save threads talk
over it, never a cell's code, so a cell's failure leaves its collectives to complete on every rank
(`checkpoint/in_flight.py` marks it). Cut, a save in flight failed on some ranks, and a rank whose
save thread reached the re-formed group waited there for peers that had given up.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

from fsdp2nb.checkpoint.in_flight import is_background_group
from fsdp2nb.errors import forget_locals
from fsdp2nb.worker.collective_count import note_entered
from fsdp2nb.worker.error_kinds import error_kind

BACKEND_NAME = "reformable_gloo"
"""What `torch.distributed.get_backend()` says of a CPU pool's groups."""


class ReformableGlooGroup(dist.ProcessGroup):
    """A gloo process group whose connections can be cut and made anew in the same process."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta, group_name: str) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._group_name = group_name
        self._generation = 0
        self._inner, self._sockets = self._connect()
        # Torch checks a group's device types before some calls (DCP's async save); the first
        # backend stands for the CPU there, while every collective goes to the current one.
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               self._inner._get_backend(torch.device("cpu")))

    # --- what torch asks of a Python process group ------------------------------------------------

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def getBackendName(self) -> str:  # the name torch calls
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    # --- connections -------------------------------------------------------------------------------

    def _connect(self) -> tuple[dist.ProcessGroup, frozenset[int]]:
        """A plain process group over a fresh gloo backend, and the inodes of the sockets that
        backend opened (its pairs and listener)."""
        before = set(_socket_fds())
        options = ProcessGroupGloo._Options()
        options._timeout = self._timeout
        options._devices = gloo_devices()
        store = PrefixStore(f"generation-{self._generation}", self._store)
        backend = ProcessGroupGloo(store, self.rank(), self.size(), options)
        sockets = frozenset(set(_socket_fds()) - before)
        inner = dist.ProcessGroup(store, self.rank(), self.size())
        inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        return inner, sockets

    def release(self) -> int:
        """Shut down this group's connected sockets (not its listener: gloo aborts the process on
        that); every collective on them, here and on the peers, fails at once. The count cut."""
        cut = 0
        for inode, fd in _socket_fds().items():
            if inode in self._sockets and _shut_down_if_connected(fd):
                cut += 1
        return cut

    @property
    def sockets(self) -> frozenset[int]:
        """The inodes of the current connections' sockets and listener."""
        return self._sockets

    def reform(self, generation: int) -> None:
        """Connect afresh under `generation`'s prefix; every member of the group must call it."""
        self._generation = generation
        self._inner, self._sockets = self._connect()

def gloo_devices() -> list:
    """The devices torch's own gloo groups take: one per interface in GLOO_SOCKET_IFNAME (the
    pool sets it to the interface that reaches the other hosts, or `lo`), else the address the
    hostname resolves to. Options built by hand skip torch's reading of the variable, and on a
    host whose name resolves to loopback every peer would be told to connect to 127.0.0.1."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if not names:
        return [ProcessGroupGloo.create_default_device()]
    return [ProcessGroupGloo.create_device(interface=name) for name in names]


_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "allgather_coalesced",
    "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "gather", "scatter", "alltoall", "alltoall_base", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "recv_anysource", "_start_coalescing", "_end_coalescing",
)
"""Every operation of a process group that talks to peers: each goes to the current inner group."""


def _delegate(name: str):
    def collective(self: ReformableGlooGroup, *args, **kwargs):
        note_entered()  # the progress the kernel's waiting line reads
        return getattr(self._inner, name)(*args, **kwargs)

    collective.__name__ = name
    return collective


for _name in _COLLECTIVES:
    setattr(ReformableGlooGroup, _name, _delegate(_name))


# --- the groups of this rank ---------------------------------------------------------------------

_groups: list[ReformableGlooGroup] = []
"""Every group this rank made, in the order made: the same order on every member, so re-forming
them one after another never waits on a peer that re-forms another group first."""
_groups_lock = threading.Lock()
_released = threading.Event()

RELEASE_ARRIVAL_WAIT_S = 10.0
"""How long a re-forming waits for the release it follows to be carried out on this rank."""
_releases = threading.Condition()
"""Held while a release cuts, so that a re-forming never interleaves with it."""
_carried_out: set[int] = set()
"""Ids of releases carried out here that no re-forming has waited for yet."""
_given_up: set[int] = set()
"""Ids of releases a re-forming stopped waiting for: dropped if they come after all."""


def register_backend() -> None:
    """Make `BACKEND_NAME` a backend `init_process_group` and `new_group` can use (once)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True, devices=["cpu"])


def _create_group(options, _backend_options) -> ReformableGlooGroup:
    group = ReformableGlooGroup(options.store, options.group_rank, options.group_size, options.timeout,
                                options.group_id)
    live_groups()  # lets go of destroyed ones, whose connections would otherwise stay open
    with _groups_lock:
        _groups.append(group)
    return group


def live_groups() -> list[ReformableGlooGroup]:
    """The groups not destroyed (`destroy_process_group` drops them from torch's map)."""
    alive = set(map(id, dist.distributed_c10d._world.pg_map)) if dist.is_initialized() else set()
    with _groups_lock:
        _groups[:] = [group for group in _groups if id(group) in alive]
        return list(_groups)


def cell_groups() -> list[ReformableGlooGroup]:
    """The live groups a cell's code may wait in: all but the background saves' own."""
    return [group for group in live_groups() if not is_background_group(group)]


def unreformable_groups() -> list[str]:
    """Descriptions of the groups of another backend (plain gloo, made with `backend="gloo"`)."""
    if not dist.is_initialized():
        return []
    world = dist.distributed_c10d._world
    return [f"{world.pg_names.get(group, '?')} ({backend})" for group, (backend, _) in world.pg_map.items()
            if not isinstance(group, ReformableGlooGroup)]


def release_collectives(release_id: int) -> int:
    """Cut every cell group's connections (the control thread calls it while the main thread may
    be blocked in one); returns how many were cut, 0 for a release the groups were re-formed after."""
    with _releases:
        if release_id in _given_up:
            _given_up.discard(release_id)
            return 0
        _released.set()
        cut = sum(group.release() for group in cell_groups())
        _carried_out.add(release_id)
        _releases.notify_all()
        return cut


def was_released() -> bool:
    """Whether this rank's groups were cut since they were last re-formed."""
    return _released.is_set()


def reform_groups(generation: int, after_release: int | None = None) -> int:
    """Give every cell group fresh connections under `generation`, once the release
    `after_release` (if any) was carried out here; returns how many were re-formed."""
    if after_release is not None:
        _wait_for_release(after_release)
        _forget_released_errors()
    groups = cell_groups()
    replaced = frozenset().union(*(group.sockets for group in groups))
    for group in groups:
        group.reform(generation)
    _released.clear()
    if replaced & set(_socket_fds()):
        gc.collect()  # held in reference cycles only: freed now rather than at a full collection much later
    return len(groups)


def _forget_released_errors() -> None:
    """Clear the locals of the released cell's error frames. They hold gloo's work object, and
    it the connections being replaced: their sockets, pipes, epoll and loop thread. Decided here,
    not when the cell ended: a rank whose peer cut first sees its collective fail before its own
    release arrives, and IPython keeps that error as `sys.last_value`. A released error is shown
    as one line and has no post-mortem."""
    from IPython import get_ipython

    shell = get_ipython()
    for error in (getattr(shell, "released_error", None), getattr(sys, "last_value", None)):
        if isinstance(error, BaseException) and error_kind(error, released=True) == "released":
            forget_locals(error)
    if shell is not None:
        shell.released_error = None


def _wait_for_release(release_id: int) -> None:
    """Wait until the control thread carried out `release_id`; past RELEASE_ARRIVAL_WAIT_S it is
    dropped if it comes (the lock is not held while the groups connect: interrupts stay served)."""
    with _releases:
        if not _releases.wait_for(lambda: release_id in _carried_out, timeout=RELEASE_ARRIVAL_WAIT_S):
            _given_up.add(release_id)
        _carried_out.discard(release_id)


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> fd."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(name)
    return found


def _shut_down_if_connected(fd: int) -> bool:
    """Shut the socket behind `fd` down both ways if it is connected; through a duplicate, so
    the fd gloo owns stays open (it is gloo's to close)."""
    try:
        duplicate = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with duplicate:
        if duplicate.family not in (socket.AF_INET, socket.AF_INET6):  # the kernel's channels: Unix
            return False
        try:
            duplicate.getpeername()
            duplicate.shutdown(socket.SHUT_RDWR)
        except OSError:  # a listener, or already shut down
            return False
    return True
