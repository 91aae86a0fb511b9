"""The kernel's and the ranks' ends of the pool's stream sockets.

The kernel listens on one socket: a Unix socket in the pool's private (0700) runtime directory,
or, for ranks on other hosts, TCP with TLS on its cluster-facing address (`endpoints`). Every rank
opens three connections to it, each greeted with a challenge and the kernel's wire version, and
introduced by a signed `ChannelHello` that carries the challenge back and the sender's version
(an end of another version is refused in one line on both sides: wire/versions.py):
- requests: kernel -> rank, read by the rank's main thread (cells, push, pull, shutdown);
- control: kernel -> rank, read by the rank's control thread (interrupts, save requests), so
  these act while a cell runs;
- events: rank -> kernel, shared by all the rank's threads (output, results, snapshots). One
  ordered stream per process means a rank's output always arrives before its `CellFinished`.
The host agent opens an events connection only. `admission` introduces each connection (a
signed hello that answers a fresh challenge); a second connection for a role and rank already
connected is refused. Events connections are read without blocking: a rank stopped in the middle
of a frame holds up no other rank, and is reported once it stays so for `STALLED_FRAME_S`.

Frames are laid out by `framing` and signed by `signing`. Plain sockets wake the reader
directly, where a ZeroMQ socket hands every message through an extra I/O thread on each side
(docs/benchmarks.md compares the round trips).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from fsdp2nb.errors import WireVersionMismatch
from fsdp2nb.wire import endpoints
from fsdp2nb.wire.admission import CHALLENGE_BYTES, HELLO_TIMEOUT_S, Admission
from fsdp2nb.wire.framing import FrameReader, Link
from fsdp2nb.wire.protocol import ChannelHello, ChannelRole
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.tls import PoolCertificate, server_context
from fsdp2nb.wire.versions import MAX_VERSION_BYTES, WireVersion, install_hint, ours

logger = logging.getLogger(__name__)

STALLED_FRAME_S = 10.0
"""How long a frame may stay half-received before its sender is reported as stalled."""

OnStalled = Callable[[int | None, float], None]
"""Told the rank (None: the host agent) that stopped in the middle of a frame, and for how long."""


OnAgentLost = Callable[[int, str], None]
"""Told the node and host address of a host agent whose events connection ended."""


def _peer_host(sock: socket.socket) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return ""
    return peer[0] if isinstance(peer, tuple) else ""


def peer_name(rank: int | None) -> str:
    return "the host agent" if rank is None else f"rank {rank}"


LinkKey = tuple[ChannelRole, "int | str"]
"""A connection's role and its sender: a rank, or "agent N" for the host agent of node N."""


def link_key(hello: ChannelHello) -> LinkKey:
    return hello.role, (hello.rank if hello.rank is not None else f"agent {hello.node}")


class _EventSource:
    """An events connection being read: its frames so far and who sends them."""

    def __init__(self, link: Link, key: LinkKey, hello: ChannelHello) -> None:
        self.link = link
        self.frames = FrameReader(link.sock)
        self.key = key
        self.rank = hello.rank
        self.node = hello.node
        self.peer_host = _peer_host(link.sock)
        self.stall_reported = False


class KernelChannels:
    """The kernel's end: accepts rank connections; sends from any thread.

    Events are read (`receive`) by one thread at a time: the one waiting for a request's events,
    else the pool's receiving thread (pool/event_reader.py).
    """

    def __init__(self, signer: Signer, address: str, *, log: logging.Logger = logger,
                 stalled_frame_s: float = STALLED_FRAME_S, on_stalled: OnStalled | None = None,
                 certificate: PoolCertificate | None = None, on_agent_lost: OnAgentLost | None = None) -> None:
        self._signer = signer
        self._on_agent_lost = on_agent_lost
        self._log = log
        self._stalled_frame_s = stalled_frame_s
        self._on_stalled = on_stalled
        self._links: dict[LinkKey, Link] = {}
        """Every introduced connection, by role and rank (events links too: one per rank)."""
        self._links_changed = threading.Condition()
        # The reader waits on one epoll set, built up as events connections arrive (the
        # admitting thread queues them and wakes the reader through a pipe): rebuilding a
        # selector for every wait cost the kernel time on every event.
        self._epoll = select.epoll()
        self._read_lock = threading.Lock()
        """Held while frames are read and delivered (close() must not close links meanwhile)."""
        self._readers: dict[int, _EventSource] = {}
        self._part_read: set[_EventSource] = set()
        """Sources with a frame begun and not yet complete (watched for stalls)."""
        self._wake_read, self._wake_write = os.pipe()
        self._wake_lock = threading.Lock()
        """Held while the wake-up pipe is written or closed: a closed fd's number may be reused."""
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)  # a full pipe already wakes the reader
        self._epoll.register(self._wake_read, select.EPOLLIN)
        self._unregistered: collections.deque[_EventSource] = collections.deque()
        self._closed = False
        if endpoints.is_tcp(address) and certificate is None:
            raise ValueError("a TCP listener needs the pool's certificate: nothing crosses a network unencrypted")  # internal: the pool always passes its certificate
        server = endpoints.listen(address)
        self._server = server
        self.address = endpoints.bound_address(server)
        """Where ranks connect (with the port the system picked for `tcp://HOST:0`)."""
        tls = server_context(certificate) if certificate is not None else None
        self._admission = Admission(server, signer, self._admit, log, tls=tls)

    @property
    def closed(self) -> bool:
        return self._closed

    def wake_reader(self) -> None:
        """Make a `receive` waiting on another thread return now (nothing is read for it)."""
        with self._wake_lock:
            if not self._closed:
                _write_wake_up(self._wake_write)

    @property
    def refused_version(self) -> str | None:
        """Why the last connection of another wire version was refused (one line), if one was."""
        return self._admission.refused_version

    def send(self, ranks: int | tuple[int, ...], message: Any, *, control: bool = False,
             connect_timeout_s: float = 5.0) -> None:
        """Send to one rank or several (packed and signed once); waits briefly for a rank whose
        connection is still being set up."""
        role: ChannelRole = "control" if control else "requests"
        frame = self._signer.pack(message)
        for rank in (ranks,) if isinstance(ranks, int) else ranks:
            link = self._links.get((role, rank)) or self._wait_for_link(role, rank, connect_timeout_s)
            if link is None:
                raise ConnectionError(f"rank {rank} is not connected to the pool")
            try:
                link.send(frame)
            except OSError as error:
                raise ConnectionError(f"rank {rank} is not connected to the pool ({error})") from error

    def has_links(self, ranks: Iterable[int]) -> bool:
        """Whether each of `ranks` has its requests and control connections set up here: a rank
        says it joined on its events connection, which may be admitted before the other two."""
        with self._links_changed:
            return all((role, rank) in self._links for rank in ranks for role in ("requests", "control"))

    def _wait_for_link(self, role: ChannelRole, rank: int, timeout_s: float) -> Link | None:
        with self._links_changed:
            self._links_changed.wait_for(lambda: (role, rank) in self._links or self._closed, timeout_s)
            return self._links.get((role, rank))

    def receive(self, timeout_ms: int, deliver: Callable[[Any], None]) -> None:
        """Wait up to `timeout_ms` for events and pass each verified one to `deliver`, in order."""
        if self._unregistered:
            with self._read_lock:
                if not self._closed:
                    self._register_new_links()
        ready = self._wait_ready(timeout_ms)
        with self._read_lock:
            if self._closed:
                return
            for fd, _ in ready:
                source = self._readers.get(fd)
                if source is None:  # the admitting thread's wake-up: new links are registered next call
                    _drain(self._wake_read)
                else:
                    self._read(source, deliver)
            if self._part_read:
                self._report_stalls()

    def _wait_ready(self, timeout_ms: int) -> list[tuple[int, int]]:
        """The (fd, event) pairs ready within `timeout_ms`; none once the channels are closed."""
        try:
            return self._epoll.poll(timeout_ms / 1000)
        except (OSError, ValueError):  # closed under us by close()
            return []

    def _register_new_links(self) -> None:
        """Called with the read lock held."""
        while self._unregistered:
            source = self._unregistered.popleft()
            fd = source.link.fileno()
            self._readers[fd] = source
            self._epoll.register(fd, select.EPOLLIN)

    def _read(self, source: _EventSource, deliver: Callable[[Any], None]) -> None:
        """Deliver each verified message that `source` completed; never waits for more bytes.

        A frame that fails verification is dropped (one line in the log); a closed connection
        is dropped."""
        try:
            frames = source.frames.read_available()
        except (EOFError, OSError) as error:
            if source.frames.stalled_since is not None or not isinstance(error, EOFError):
                self._log.warning("dropped the events connection of %s: %s", peer_name(source.rank), error)
            self._drop(source)
            return
        for frame in frames:
            message = self._signer.unpack(frame)
            if message is not None:
                deliver(message)
        if source.frames.stalled_since is not None:
            self._part_read.add(source)
        elif self._part_read:
            self._resumed(source)

    def _drop(self, source: _EventSource) -> None:
        """Called with the read lock held."""
        fd = source.link.fileno()
        self._epoll.unregister(fd)
        del self._readers[fd]
        self._part_read.discard(source)
        with self._links_changed:
            if self._links.get(source.key) is source.link:
                del self._links[source.key]
        source.link.close()
        if source.rank is None and self._on_agent_lost is not None:
            self._on_agent_lost(source.node, source.peer_host)

    def _report_stalls(self) -> None:
        """Report, once each, the senders whose frame has stayed incomplete for too long."""
        now = time.monotonic()
        for source in self._part_read:
            stalled_s = now - (source.frames.stalled_since or now)
            if not source.stall_reported and stalled_s >= self._stalled_frame_s:
                source.stall_reported = True
                self._log.warning("%s stopped in the middle of a message %.0f s ago", peer_name(source.rank), stalled_s)
                if self._on_stalled is not None:
                    self._on_stalled(source.rank, stalled_s)

    def _resumed(self, source: _EventSource) -> None:
        self._part_read.discard(source)
        if source.stall_reported:
            source.stall_reported = False
            self._log.warning("%s resumed sending", peer_name(source.rank))

    def _admit(self, hello: ChannelHello, sock: socket.socket) -> str | None:
        """Register an introduced connection under its role and rank; or why it is refused."""
        key = link_key(hello)
        with self._links_changed:
            if self._closed:
                return "the pool is closing"
            current = self._links.get(key)
            if current is not None and not _hung_up(current.sock):
                return (f"{peer_name(hello.rank)} already has a {hello.role} connection "
                        "(a second one is refused; the first stays in use)")
            if current is not None and hello.role != "events":  # the reader drops a closed events link
                current.close()
            link = Link(sock)
            self._links[key] = link
            if hello.role == "events":
                self._unregistered.append(_EventSource(link, key, hello))
                _write_wake_up(self._wake_write)
            else:
                sock.setblocking(True)  # sent to from the kernel's threads; never read here
            self._links_changed.notify_all()
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._admission.close()
        self._server.close()
        with self._links_changed:
            self._links_changed.notify_all()
            links = list(self._links.values())
            self._links.clear()
        with self._read_lock:  # not while a reader reads from them
            for link in links:
                link.close()
            self._epoll.close()
        with self._wake_lock:
            os.close(self._wake_read)
            os.close(self._wake_write)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer of `sock` closed its end (checked without reading)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    return bool(poller.poll(0))


def _write_wake_up(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"x")


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


class RankChannels:
    """A rank's (or agent's) end. `send_event` may be called from any thread.

    A kept pool's end (`kept`) outlives its kernel: an event it cannot send is dropped (what the
    rank prints is in its log anyway) instead of raising into user code, and `reconnect` moves
    every connection to the next kernel's socket."""

    def __init__(self, signer: Signer, address: str, *, rank: int | None, fingerprint: str = "",
                 node: int = 0, kept: bool = False) -> None:
        self._signer = signer
        self._fingerprint = fingerprint
        self._node = node
        self._rank = rank
        self.kept = kept
        self.generation = 0
        """Grows with every `reconnect`: a reader that met the end of a connection waits for it."""
        self._reconnected = threading.Condition()
        self._events_lost = False
        self._events = self._connect(address, "events", rank)
        self._requests = self._control = None
        if rank is not None:
            self._requests = self._connect(address, "requests", rank)
            self._control = self._connect(address, "control", rank)
        self._closed = False

    def reconnect(self, address: str) -> None:
        """Open fresh connections to `address` (each through admission), then drop the old ones,
        which wakes a reader blocked on them. Raises OSError (nothing changed) if one fails."""
        fresh: list[Link] = []
        try:
            for role in ("events", "requests", "control") if self._rank is not None else ("events",):
                fresh.append(self._connect(address, role, self._rank))
        except (OSError, EOFError, WireVersionMismatch) as error:
            for link in fresh:
                link.close()
            raise OSError(f"could not reconnect to {address}: {error}") from error  # internal: a lost connection, handled by the caller's recovery
        old = [self._events, self._requests, self._control]
        with self._reconnected:
            self._events = fresh[0]
            if self._rank is not None:
                self._requests, self._control = fresh[1], fresh[2]
            self._events_lost = False
            self.generation += 1
            self._reconnected.notify_all()
        for replaced in old:
            if replaced is not None:
                with contextlib.suppress(OSError):
                    replaced.sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end; it closes nothing

    def wait_for_reconnect(self, generation: int) -> bool:
        """Block until connections newer than `generation` exist; False once closed."""
        with self._reconnected:
            self._reconnected.wait_for(lambda: self.generation > generation or self._closed)
            return not self._closed

    def _connect(self, address: str, role: ChannelRole, rank: int | None) -> Link:
        """A connection introduced by a signed hello that answers the kernel's challenge; raises
        WireVersionMismatch (after the hello, which tells the kernel too) if the kernel speaks
        another version of the wire."""
        client = endpoints.connect(address, self._fingerprint)
        client.settimeout(HELLO_TIMEOUT_S)
        link = Link(client)
        greeting = bytes(link.receive(max_bytes=CHALLENGE_BYTES + MAX_VERSION_BYTES))
        challenge, theirs = greeting[:CHALLENGE_BYTES], WireVersion.from_bytes(greeting[CHALLENGE_BYTES:])
        client.settimeout(None)
        link.send(self._signer.pack_versioned(ChannelHello(role=role, rank=rank, challenge=challenge,
                                                           node=self._node)))
        if not theirs.matches(ours()):
            link.close()
            raise WireVersionMismatch(
                f"the kernel at {address} speaks {theirs.describe(ours())}, {peer_name(rank)} on "
                f"{socket.gethostname()} speaks {ours().describe(theirs)}: install one fsdp2nb on every host"
                + install_hint(theirs, "here"))
        return link

    def local_host(self) -> str | None:
        """This host's address on the route to the kernel (its cluster address); None over Unix sockets."""
        sock = self._events.sock
        return None if sock.family == socket.AF_UNIX else sock.getsockname()[0]

    def events_fileno(self) -> int:
        """Readable once the kernel closed the connection (it never sends on it): for watchers."""
        return self._events.fileno()

    def send_event(self, message: Any) -> bool:
        """Whether the event went out: False where a kept pool's kernel is gone (or closed)."""
        if self._closed or self._events_lost:
            return False
        link = self._events
        try:
            link.send(self._signer.pack(message))
        except OSError:
            if not self.kept:
                raise
            with self._reconnected:  # no kernel holds the pool: the rank's log has its output
                self._events_lost = link is self._events
            return False
        return True

    def control_fileno(self) -> int:
        """The control connection, for a thread that also waits for other things."""
        assert self._control is not None
        return self._control.fileno()

    def receive_request(self, timeout_ms: int) -> Any | None:
        """Called only from the rank's main thread; raises EOFError once the kernel is gone."""
        return self._receive(self._requests, timeout_ms)

    def receive_control(self, timeout_ms: int) -> Any | None:
        """Called only from the rank's control thread; raises EOFError once the kernel is gone."""
        return self._receive(self._control, timeout_ms)

    def _receive(self, link: Link | None, timeout_ms: int) -> Any | None:
        assert link is not None
        # One poll object per link, made once: selectors build and tear down one per call.
        if not link.poller.poll(timeout_ms):
            return None
        return self._signer.unpack(link.receive())

    def close(self) -> None:
        if self._closed:
            return
        with self._reconnected:
            self._closed = True
            self._reconnected.notify_all()
        for link in (self._events, self._requests, self._control):
            if link is not None:
                with link.lock:
                    link.close()
