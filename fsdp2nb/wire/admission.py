"""Admitting connections to the pool's socket: each must answer a fresh challenge with a signed hello.

The kernel greets every new connection with a random challenge and its wire version; the peer's
first frame must be a signed `ChannelHello` that carries the challenge back, so a hello recorded
from an earlier connection gets nothing, and that speaks the kernel's version (wire/versions.py):
a peer of another version is refused in one line naming both, kept in `refused_version` for the
pool to report. One thread with one epoll set introduces every connection, so a flood of idle or junk
connections costs no thread each: at most `MAX_PENDING` wait at once (the oldest is closed for a
newcomer), each for `HELLO_TIMEOUT_S` at most. A hello is read no further than its own frame, and
never into a buffer larger than a hello can be. Each refusal is one line in the pool's log.
Over TCP the TLS handshake comes first, driven by the same thread without blocking, and counts
against the same deadline.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from fsdp2nb.wire.endpoints import tune_tcp
from fsdp2nb.wire.framing import FrameTooLong
from fsdp2nb.wire.protocol import ChannelHello
from fsdp2nb.wire.signing import Signer
from fsdp2nb.wire.versions import WireVersion, install_hint, ours

HELLO_TIMEOUT_S = 10.0
"""How long a new connection may take to answer its challenge."""
MAX_PENDING = 64
"""Connections waiting to be introduced at once; the oldest goes when another comes."""
CHALLENGE_BYTES = 32
MAX_HELLO_BYTES = 4096
"""More than any real hello takes: a longer first frame is refused unread."""
_ACCEPTS_PER_PASS = 256
"""Connections accepted between two reads of hellos, so a flood cannot starve the hellos."""
_ACCEPT_RETRY_S = 0.1
_LENGTH = struct.Struct("!Q")

Admit = Callable[[ChannelHello, socket.socket], "str | None"]
"""Takes an introduced connection; or returns why it is refused (the connection is then closed)."""


class Admission:
    """Accepts connections on `server` and hands each one whose hello verifies to `admit`."""

    def __init__(self, server: socket.socket, signer: Signer, admit: Admit, log: logging.Logger, *,
                 hello_timeout_s: float = HELLO_TIMEOUT_S, max_pending: int = MAX_PENDING,
                 tls: ssl.SSLContext | None = None) -> None:
        self._server = server
        self._tls = tls
        self._server.setblocking(False)
        self._signer = signer
        self._admit = admit
        self._log = log
        self._hello_timeout_s = hello_timeout_s
        self._max_pending = max_pending
        self._pending: dict[int, _Pending] = {}
        """By file descriptor, oldest first."""
        self._epoll = select.epoll()
        self._epoll.register(server.fileno(), select.EPOLLIN)
        self._wake_read, self._wake_write = os.pipe()
        self._epoll.register(self._wake_read, select.EPOLLIN)
        self._closed = False
        self.refused_version: str | None = None
        """The last connection refused for speaking another wire version, said in one line."""
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fsdp2nb-admission")
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close every connection not yet introduced; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_write, b"x")
        self._thread.join()
        for pending in self._pending.values():
            pending.sock.close()
        self._pending.clear()
        self._epoll.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _serve(self) -> None:
        server_fd = self._server.fileno()
        while not self._closed:
            try:
                for fd, _ in self._epoll.poll(self._seconds_to_next_deadline()):
                    if fd == server_fd:
                        self._accept_waiting()
                    elif fd in self._pending:
                        self._read_hello(self._pending[fd])
                self._expire_overdue()
            except Exception:  # nothing known raises here; a bug must not end admission for good
                self._log.exception("failed while admitting connections to the pool")

    def _seconds_to_next_deadline(self) -> float:
        """-1 (no limit) when nothing waits for its hello."""
        oldest = next(iter(self._pending.values()), None)
        return -1 if oldest is None else max(0.0, oldest.deadline - time.monotonic())

    def _accept_waiting(self) -> None:
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of file descriptors, say
                if self._pending:  # make room for a newcomer: it may be a rank
                    self._refuse(next(iter(self._pending.values())), f"its file descriptor was needed ({error})")
                    continue
                self._log.warning("could not accept a connection to the pool: %s", error)
                time.sleep(_ACCEPT_RETRY_S)  # the listening socket stays ready: do not spin on it
                return
            if len(self._pending) >= self._max_pending:
                oldest = next(iter(self._pending.values()))
                self._refuse(oldest, f"it sent no hello before {self._max_pending} newer connections came")
            self._greet(sock)

    def _greet(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if self._tls is not None:
            tune_tcp(sock)
            sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        pending = _Pending(sock, secrets.token_bytes(CHALLENGE_BYTES), time.monotonic() + self._hello_timeout_s)
        self._pending[sock.fileno()] = pending
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        if self._tls is None:
            self._send_challenge(pending)

    def _send_challenge(self, pending: _Pending) -> None:
        greeting = pending.challenge + ours().to_bytes()
        try:  # a fresh socket's buffer takes the greeting whole
            pending.sock.send(_LENGTH.pack(len(greeting)) + greeting)
        except OSError as error:
            self._refuse(pending, f"it closed before its challenge was sent ({error})")

    def _shake_hands(self, pending: _Pending) -> None:
        sock = pending.sock
        assert isinstance(sock, ssl.SSLSocket), "only a TLS connection shakes hands"
        try:
            sock.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
            return  # more of the handshake is on its way
        except (ssl.SSLError, OSError) as error:
            self._refuse(pending, f"its TLS handshake failed ({error})")
            return
        pending.handshaken = True
        self._send_challenge(pending)

    def _read_hello(self, pending: _Pending) -> None:
        if not pending.handshaken:
            self._shake_hands(pending)
            return
        try:
            frame = pending.read_first_frame()
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):  # woken for nothing: wait on
            return
        except FrameTooLong as error:
            self._refuse(pending, f"its first message is too long for a hello ({error})")
            return
        except EOFError:
            self._refuse(pending, "it closed before its hello was complete")
            return
        except OSError as error:
            self._refuse(pending, f"reading its hello failed ({error})")
            return
        if frame is not None:
            self._introduce(pending, frame)

    def _introduce(self, pending: _Pending, frame: bytes) -> None:
        payload = self._signer.verify(frame)
        if payload is None:
            self._refuse(pending, "its hello failed signature verification (it was not sent with the pool's key)")
            return
        opened = self._signer.decode_versioned(payload)
        fields = opened.fields if opened is not None else {}
        if opened is None or opened.type_name not in ("ChannelHello", ""):
            self._refuse(pending, "its first message is not a hello")
            return
        challenge = fields.get("challenge")
        answered = isinstance(challenge, bytes) and hmac.compare_digest(challenge, pending.challenge)
        if opened.type_name and not answered:
            self._refuse(pending, f"its hello ({fields.get('role')}, rank {fields.get('rank')}) answers "
                                  "another connection's challenge: a replayed hello")
            return
        hello = opened.message
        if not isinstance(hello, ChannelHello):  # another version's (an older one's hello has no type name)
            self._refuse_version(pending, opened.version, fields)
            return
        self._forget(pending)
        refusal = self._admit(hello, pending.sock)
        if refusal is not None:
            pending.sock.close()
            self._log.warning("refused a connection to the pool: %s", refusal)

    def _refuse_version(self, pending: _Pending, theirs: WireVersion, fields: dict) -> None:
        if not fields:
            sender = "a connection"
        elif fields.get("rank") is None:
            sender = f"the host agent of node {fields.get('node', 0)}"
        else:
            sender = f"rank {fields['rank']}"
        host = _peer_host(pending.sock)
        line = (f"{sender}{f' on {host}' if host else ''} speaks {theirs.describe(ours())}, this kernel "
                f"speaks {ours().describe(theirs)}: install one fsdp2nb on every host"
                + install_hint(ours(), f"on {host or 'its host'}"))
        self.refused_version = line
        self._refuse(pending, line)

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self._refuse(oldest, f"it sent no hello within {self._hello_timeout_s:g} s")

    def _refuse(self, pending: _Pending, reason: str) -> None:
        self._forget(pending)
        pending.sock.close()
        self._log.warning("refused a connection to the pool: %s", reason)

    def _forget(self, pending: _Pending) -> None:
        del self._pending[pending.sock.fileno()]
        with contextlib.suppress(OSError):
            self._epoll.unregister(pending.sock.fileno())


def _peer_host(sock: socket.socket) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return ""
    return peer[0] if isinstance(peer, tuple) else ""


class _Pending:
    """A connection that was sent its challenge and has not yet answered it."""

    def __init__(self, sock: socket.socket, challenge: bytes, deadline: float) -> None:
        self.sock = sock
        self.challenge = challenge
        self.deadline = deadline
        self.handshaken = not isinstance(sock, ssl.SSLSocket)
        self._received = bytearray()

    def read_first_frame(self) -> bytes | None:
        """The first frame once it is all here; reads no byte past it, and refuses (FrameTooLong)
        a length over what a hello can take before reading any of it. Reads until the socket
        has nothing more (BlockingIOError, or SSLWantReadError): TLS may hold a record's rest
        decrypted where the socket's readiness no longer shows it."""
        while (frame := self._read_once()) is None:
            pass
        return frame

    def _read_once(self) -> bytes | None:
        if len(self._received) < _LENGTH.size:
            wanted = _LENGTH.size - len(self._received)
        else:
            wanted = _LENGTH.size + self._announced_size() - len(self._received)
        piece = self.sock.recv(wanted)
        if not piece:
            raise EOFError("closed before its first frame was complete")
        self._received += piece
        if len(self._received) < _LENGTH.size:
            return None
        if len(self._received) < _LENGTH.size + self._announced_size():
            return None
        return bytes(self._received[_LENGTH.size:])

    def _announced_size(self) -> int:
        (size,) = _LENGTH.unpack_from(self._received)
        if size > MAX_HELLO_BYTES:
            raise FrameTooLong(f"{size} bytes announced, {MAX_HELLO_BYTES} at most")
        return size
