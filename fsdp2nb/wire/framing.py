"""Framing: each frame on a stream socket is an 8-byte big-endian length, then the frame.

Frames are read with one `recv(MSG_WAITALL)` per part (multiprocessing.connection's Python loop
costs more per message).
"""

from __future__ import annotations

import select
import socket
import struct
import threading

from fsdp2nb.wire.sigint import sigint_deferred

_LENGTH = struct.Struct("!Q")
_ONE_WRITE_BYTES = 64 * 1024
"""Frames up to this size go out with their length in one write; larger ones are not copied."""


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
            raise OSError(f"a frame of {size} bytes is over the {max_bytes} allowed here")
        return _receive_exactly(self.sock, size)

    def close(self) -> None:
        self.sock.close()


def _receive_exactly(sock: socket.socket, size: int) -> bytes | bytearray:
    data = sock.recv(size, socket.MSG_WAITALL)
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
