"""The kernel's and the ranks' ends of the pool's Unix stream sockets.

The kernel listens on one socket in the pool's private (0700) runtime directory. Every rank opens
three connections to it, each introduced by a signed `ChannelHello`:
- requests: kernel -> rank, read by the rank's main thread (cells, push, pull, shutdown);
- control: kernel -> rank, read by the rank's control thread (interrupts, save requests), so
  these act while a cell runs;
- events: rank -> kernel, shared by all the rank's threads (output, results, snapshots). One
  ordered stream per process means a rank's output always arrives before its `CellFinished`.
The host agent opens an events connection only.

Frames are laid out by `framing` and signed by `signing`. Plain sockets wake the reader
directly, where a ZeroMQ socket hands every message through an extra I/O thread on each side
(the README's measured table compares the round trips).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

from fsdp2nb.wire.framing import Link
from fsdp2nb.wire.protocol import ChannelHello, ChannelRole
from fsdp2nb.wire.signing import Signer

_ACCEPT_POLL_S = 0.2
_HELLO_TIMEOUT_S = 10.0
_MAX_HELLO_BYTES = 4096


class KernelChannels:
    """The kernel's end: accepts rank connections; sends from any thread.

    Events are read by one reader at a time. The pool's background thread reads them between
    requests (`receive`); while a request runs, the thread waiting for it reads them itself
    inside `reading_here()`, which pauses the background reader. That spares each event a hop
    between threads, a thread wake-up that is a good part of an empty cell's cost.
    """

    def __init__(self, signer: Signer, address: str) -> None:
        self._signer = signer
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(address)
        self._server.listen(128)
        self._server.settimeout(_ACCEPT_POLL_S)
        self._links: dict[tuple[ChannelRole, int], Link] = {}
        self._links_changed = threading.Condition()
        self._event_links: list[Link] = []
        # Each reader waits on its own epoll set, built up as events connections arrive (the
        # accepting thread queues them and wakes the background reader through a pipe):
        # rebuilding a selector for every wait cost the kernel time on every event. Pausing
        # the background reader switches its connections off in its set, so it sleeps on.
        self._background = select.epoll()
        self._foreground = select.epoll()
        self._foreground_thread: int | None = None
        """The thread inside `reading_here()`, if any."""
        self._read_lock = threading.Lock()
        """Held while frames are read and delivered, and while the reader changes hands."""
        self._handoffs = 0
        """How often reading changed hands: a reader's wait that spans a change is stale."""
        self._readers: dict[int, Link] = {}
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._background.register(self._wake_read, select.EPOLLIN)
        self._unregistered: collections.deque[Link] = collections.deque()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="fsdp2nb-accept")
        self._acceptor.start()

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

    def _wait_for_link(self, role: ChannelRole, rank: int, timeout_s: float) -> Link | None:
        with self._links_changed:
            self._links_changed.wait_for(lambda: (role, rank) in self._links or self._closed, timeout_s)
            return self._links.get((role, rank))

    def receive(self, timeout_ms: int, deliver: Callable[[Any], None]) -> None:
        """Wait up to `timeout_ms` for events and pass each verified one to `deliver`, in order.

        The background reader's call: while another thread reads `reading_here()`, it only waits."""
        self._receive(self._background, timeout_ms, deliver)

    def receive_here(self, timeout_ms: int, deliver: Callable[[Any], None]) -> None:
        """As `receive`, for the thread inside `reading_here()`."""
        assert self.reads_here(), "receive_here is for the thread inside reading_here()"
        self._receive(self._foreground, timeout_ms, deliver)

    def reading_here(self) -> contextlib.AbstractContextManager:
        """While inside, events are read only by the calling thread's `receive_here`.

        Entering waits for the background reader to deliver what it has read, so the caller
        sees every event in order after those."""
        return _ReadingHere(self)

    def reads_here(self) -> bool:
        """Whether the calling thread is the one inside `reading_here()`."""
        return self._foreground_thread == threading.get_ident()

    def _take_reading(self) -> None:
        with self._read_lock:
            self._register_new_links()
            self._foreground_thread = threading.get_ident()
            self._handoffs += 1
            self._switch_background(0)

    def _give_reading_back(self) -> None:
        with self._read_lock:
            self._foreground_thread = None
            self._handoffs += 1
            if not self._closed:
                self._switch_background(select.EPOLLIN)

    def _switch_background(self, mask: int) -> None:
        for fd in self._readers:
            self._background.modify(fd, mask)

    def _receive(self, epoll: select.epoll, timeout_ms: int, deliver: Callable[[Any], None]) -> None:
        if self._unregistered:
            with self._read_lock:
                if not self._closed:
                    self._register_new_links()
        handoffs = self._handoffs
        ready = self._wait_ready(epoll, timeout_ms)
        with self._read_lock:
            if self._closed:
                return
            if self._handoffs != handoffs:
                # Reading changed hands while this reader waited: what it saw ready may have been
                # read since, and a link without a frame would block the read (lock held).
                ready = [(fd, event) for fd, event in ready if self._readers.get(fd) is None]
            for fd, _ in ready:
                link = self._readers.get(fd)
                if link is None:  # the accepting thread's wake-up: new links are registered next call
                    _drain(self._wake_read)
                elif epoll is self._foreground or self._foreground_thread is None:
                    message = self._read(link)
                    if message is not None:
                        deliver(message)

    def _wait_ready(self, epoll: select.epoll, timeout_ms: int) -> list[tuple[int, int]]:
        """The (fd, event) pairs ready within `timeout_ms`; none once the channels are closed."""
        try:
            return epoll.poll(timeout_ms / 1000)
        except (OSError, ValueError):  # closed under us by close()
            return []

    def _register_new_links(self) -> None:
        """Called with the read lock held."""
        while self._unregistered:
            link = self._unregistered.popleft()
            self._readers[link.fileno()] = link
            self._foreground.register(link.fileno(), select.EPOLLIN)
            self._background.register(link.fileno(), 0 if self._foreground_thread is not None else select.EPOLLIN)

    def _read(self, link: Link) -> Any | None:
        """The next message on `link`, or None (a frame that failed verification, or the
        connection closed: then the link is dropped)."""
        try:
            frame = link.receive()
        except (EOFError, OSError):
            for epoll in (self._background, self._foreground):
                epoll.unregister(link.fileno())
            del self._readers[link.fileno()]
            with self._links_changed:
                self._event_links.remove(link)
            link.close()
            return None
        return self._signer.unpack(frame)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._introduce, args=(client,), daemon=True).start()

    def _introduce(self, client: socket.socket) -> None:
        """Register a connection under the role its signed hello names; drop it otherwise."""
        client.settimeout(_HELLO_TIMEOUT_S)  # a peer that sends nothing is dropped
        link = Link(client)
        try:
            hello = self._signer.unpack(link.receive(max_bytes=_MAX_HELLO_BYTES))
            client.settimeout(None)
        except (EOFError, OSError):  # also a hello longer than any real one, or none in time
            hello = None
        if not isinstance(hello, ChannelHello):
            link.close()
            return
        with self._links_changed:
            if self._closed:
                link.close()
                return
            if hello.role == "events":
                self._event_links.append(link)
                self._unregistered.append(link)
                os.write(self._wake_write, b"x")
            else:
                replaced = self._links.get((hello.role, hello.rank))
                if replaced is not None:
                    replaced.close()
                self._links[(hello.role, hello.rank)] = link
            self._links_changed.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.close()
        with self._links_changed:
            self._links_changed.notify_all()
            links = [*self._links.values(), *self._event_links]
            self._links.clear()
            self._event_links.clear()
        with self._read_lock:  # not while a reader reads from them
            for link in links:
                link.close()
            self._background.close()
            self._foreground.close()
        os.close(self._wake_read)
        os.close(self._wake_write)


class _ReadingHere:
    """The context of `KernelChannels.reading_here` (a class: entered on every request)."""

    def __init__(self, channels: KernelChannels) -> None:
        self._channels = channels

    def __enter__(self) -> None:
        self._channels._take_reading()

    def __exit__(self, *exc_info) -> None:
        self._channels._give_reading_back()


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


class RankChannels:
    """A rank's (or agent's) end. `send_event` may be called from any thread."""

    def __init__(self, signer: Signer, address: str, *, rank: int | None) -> None:
        self._signer = signer
        self._events = self._connect(address, "events", rank)
        self._requests = self._control = None
        if rank is not None:
            self._requests = self._connect(address, "requests", rank)
            self._control = self._connect(address, "control", rank)
        self._closed = False

    def _connect(self, address: str, role: ChannelRole, rank: int | None) -> Link:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(address)
        link = Link(client)
        link.send(self._signer.pack(ChannelHello(role=role, rank=rank)))
        return link

    def send_event(self, message: Any) -> None:
        if not self._closed:
            self._events.send(self._signer.pack(message))

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
        self._closed = True
        for link in (self._events, self._requests, self._control):
            if link is not None:
                with link.lock:
                    link.close()
