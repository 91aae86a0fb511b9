"""Framing: each frame on a stream socket is an 8-byte big-endian length, then the frame.

A blocking `Link` reads a frame with one `recv(MSG_WAITALL)` per part (multiprocessing.connection's
Python loop costs more per message). The kernel reads its many peers through `FrameReader`s
instead, which take what a non-blocking socket has and never wait for the rest of a frame: one
peer stopped in the middle of a frame must not stall the others.

A length prefix is only a claim: memory grows with the bytes that actually arrive, never
by the length a peer announces.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time

from fsdp2nb.errors import Fsdp2nbError
from fsdp2nb.host.sigint import sigint_deferred

_LENGTH = struct.Struct("!Q")
_ONE_WRITE_BYTES = 64 * 1024
"""Frames up to this size go out with their length in one write; larger ones are not copied."""
_TRUSTED_ALLOCATION_BYTES = 1024 * 1024
"""A frame up to this size is read into a buffer of its announced size; a larger one grows as
its bytes arrive."""
_READ_BYTES = 64 * 1024
"""The most a `FrameReader` asks the socket for at once (below malloc's threshold for mmap)."""
_MAX_READS = 64


class Link:
    """One framed connection with a lock, so several threads may send on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.poller = select.poll()  # for the one thread that reads this link
        self.poller.register(sock.fileno(), select.POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: bytes) -> None:
        header = _LENGTH.pack(len(frame))
        with self.lock, sigint_deferred():
            if len(frame) <= _ONE_WRITE_BYTES:
                self.sock.sendall(header + frame)
            else:
                self.sock.sendall(header)
                self.sock.sendall(frame)

    def receive(self, max_bytes: int | None = None) -> bytes | bytearray:
        """The next frame; EOFError when the other end closed, OSError for one over `max_bytes`."""
        (size,) = _LENGTH.unpack(_receive_exactly(self.sock, _LENGTH.size))
        if max_bytes is not None and size > max_bytes:
            raise OSError(f"a frame of {size} bytes is over the {max_bytes} allowed here")  # internal: a peer's oversized frame, refused as a broken connection
        return _receive_exactly(self.sock, size)

    def close(self) -> None:
        self.sock.close()


def _receive_exactly(sock: socket.socket, size: int) -> bytes | bytearray:
    if size > _TRUSTED_ALLOCATION_BYTES:
        return _receive_growing(sock, size)
    # TLS takes no recv flags, and hands out one record (16 KiB at most) per call.
    data = sock.recv(size) if isinstance(sock, ssl.SSLSocket) else sock.recv(size, socket.MSG_WAITALL)
    if len(data) == size:
        return data
    if not data and size:
        raise EOFError("the connection was closed")
    # Cut short (a signal, or the peer closed mid-frame): gather the rest in place.
    buffer = bytearray(size)
    buffer[:len(data)] = data
    view, received = memoryview(buffer), len(data)
    while received < size:
        count = sock.recv_into(view[received:], size - received)
        if not count:
            raise EOFError("the connection was closed in the middle of a frame")
        received += count
    return buffer


def _receive_growing(sock: socket.socket, size: int) -> bytearray:
    """`size` bytes, read in pieces: the buffer never outgrows what the peer really sent."""
    buffer = bytearray()
    while len(buffer) < size:
        wanted = min(size - len(buffer), _TRUSTED_ALLOCATION_BYTES)
        piece = sock.recv(wanted) if isinstance(sock, ssl.SSLSocket) else sock.recv(wanted, socket.MSG_WAITALL)
        if not piece:
            raise EOFError("the connection was closed in the middle of a frame")
        buffer += piece
    return buffer


class FrameTooLong(Fsdp2nbError, OSError):
    """A peer announced a frame longer than the reader allows."""


class FrameReader:
    """The frames of one non-blocking socket, reassembled from whatever bytes have arrived.

    `read_available()` never waits: bytes of a frame still incomplete stay buffered for the next
    call, and `stalled_since` tells since when no byte of it came.
    """

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int | None = None) -> None:
        self.sock = sock
        self._max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self.stalled_since: float | None = None
        """When the last byte of an incomplete frame arrived; None between frames."""

    def read_available(self) -> list[bytes]:
        """The frames completed by what the socket has now (maybe none).

        EOFError once the peer closed; FrameTooLong for a frame over `max_frame_bytes`."""
        try:
            first = self.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            return []
        if not self._buffer and _is_one_whole_frame(first, self._max_frame_bytes) and not _tls_pending(self.sock):
            return [first[_LENGTH.size:]]  # the usual case: nothing to join, nothing left over
        chunks = self._receive_more(first)
        if self._buffer or len(chunks) > 1:
            for chunk in chunks:
                self._buffer += chunk
            data: bytes | bytearray = self._buffer
        else:
            data = chunks[0]
        frames, used = _split_frames(data, self._max_frame_bytes)
        self._keep_unused(data, used)
        self.stalled_since = time.monotonic() if self._buffer else None
        return frames

    def _keep_unused(self, data: bytes | bytearray, used: int) -> None:
        """Buffer the start of a frame not yet whole, without copying a growing buffer again."""
        if data is not self._buffer:
            self._buffer = bytearray(memoryview(data)[used:])
        elif used:
            del self._buffer[:used]  # bytearray drops its front in place

    def _receive_more(self, first: bytes) -> list[bytes]:
        """`first` and what else the socket has, up to `_MAX_READS` reads (a busy peer must not
        starve the others)."""
        if not first:
            raise EOFError("the connection was closed" + (" in the middle of a frame" if self._buffer else ""))
        chunks = [first]
        # A TLS socket gives one record per call, so a short read does not mean it is drained.
        secure = isinstance(self.sock, ssl.SSLSocket)
        while (secure or len(chunks[-1]) == _READ_BYTES) and len(chunks) < _MAX_READS:
            try:
                chunk = self.sock.recv(_READ_BYTES)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                break
            if not chunk:
                break  # the end is seen again on the next call, after these frames
            chunks.append(chunk)
        return chunks

    def fileno(self) -> int:
        return self.sock.fileno()


def _tls_pending(sock: socket.socket) -> bool:
    """Whether TLS holds decrypted bytes that the socket's readiness no longer shows."""
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def _is_one_whole_frame(data: bytes, max_frame_bytes: int | None) -> bool:
    size = len(data) - _LENGTH.size
    return (0 < size < _READ_BYTES - _LENGTH.size and _LENGTH.unpack_from(data)[0] == size
            and (max_frame_bytes is None or size <= max_frame_bytes))


def _split_frames(data: bytes | bytearray, max_frame_bytes: int | None) -> tuple[list[bytes], int]:
    """The whole frames at the start of `data`, and how many bytes they take."""
    frames, offset = [], 0
    with memoryview(data) as view:  # released before the caller resizes `data`
        while len(data) - offset >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(data, offset)
            if max_frame_bytes is not None and size > max_frame_bytes:
                raise FrameTooLong(f"a frame of {size} bytes is over the {max_frame_bytes} allowed here")
            end = offset + _LENGTH.size + size
            if end > len(data):
                break
            frames.append(bytes(view[offset + _LENGTH.size:end]))
            offset = end
    return frames, offset
