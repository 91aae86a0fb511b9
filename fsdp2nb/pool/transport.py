"""Signed messages over ZeroMQ between the notebook kernel and its ranks.

Two channels per pool, both Unix sockets in the pool's private (0700) runtime directory:
- control: the kernel's ROUTER sends requests to one rank at a time. Each rank connects two
  DEALERs: `rank-N`, read by its main thread (cells, push, pull, shutdown), and
  `rank-N-control`, read by its control thread (interrupts, save requests) so that those act
  while a cell runs.
- events: every rank process and host agent PUSHes to the kernel's PULL. Output, results,
  snapshots and exits share this one ordered stream per sender, so a rank's output always
  arrives before its `CellFinished`.
Every message is `[hmac_sha256(key, payload), payload]`; a frame set that fails verification is
dropped without being unpickled.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import pickle
import threading
import time
from typing import Any

import zmq

logger = logging.getLogger(__name__)

KEY_BYTES = 32


def rank_identity(rank: int, *, control: bool = False) -> bytes:
    """Each rank connects two DEALERs: one read by its main thread (requests that run code) and one
    read by its control thread (requests that must act while code runs)."""
    return f"rank-{rank}{'-control' if control else ''}".encode()


class Signer:
    """Packs messages into signed frames and unpacks only frames whose signature verifies."""

    def __init__(self, key: bytes) -> None:
        if len(key) < KEY_BYTES:
            raise ValueError(f"the pool key must have at least {KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self.num_rejected = 0

    def pack(self, message: Any) -> list[bytes]:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return [self._sign(payload), payload]

    def unpack(self, frames: list[bytes]) -> Any | None:
        """The message, or None when the frames are malformed or their signature is wrong."""
        if len(frames) != 2 or not hmac.compare_digest(frames[0], self._sign(frames[1])):
            self.num_rejected += 1
            logger.warning("dropped a message that failed signature verification")
            return None
        return pickle.loads(frames[1])

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()


class KernelChannels:
    """The kernel's end: binds both sockets; one thread sends control, one thread receives events."""

    def __init__(self, signer: Signer, control_address: str, events_address: str) -> None:
        self._signer = signer
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(control_address)
        self._events = self._context.socket(zmq.PULL)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(events_address)
        self._closed = False

    def send(self, rank: int, message: Any, *, control: bool = False, connect_timeout_s: float = 5.0) -> None:
        """Send to one rank; waits briefly for a rank whose connection is still being set up."""
        frames = [rank_identity(rank, control=control), *self._signer.pack(message)]
        deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                self._control.send_multipart(frames, copy=False)
                return
            except zmq.ZMQError as error:
                if error.errno != errno.EHOSTUNREACH or time.monotonic() > deadline:
                    raise ConnectionError(f"rank {rank} is not connected to the pool") from error
                time.sleep(0.005)

    def receive(self, timeout_ms: int) -> Any | None:
        """The next verified event, or None after `timeout_ms` without one."""
        if not self._events.poll(timeout_ms):
            return None
        return self._signer.unpack(self._events.recv_multipart())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._control.close()
        self._events.close()
        self._context.term()


class RankChannels:
    """A rank's (or agent's) end. `send_event` may be called from any thread."""

    def __init__(self, signer: Signer, events_address: str, *, control_address: str | None, rank: int | None):
        self._signer = signer
        self._context = zmq.Context()
        self._events = self._context.socket(zmq.PUSH)
        self._events.setsockopt(zmq.LINGER, 2000)
        self._events.connect(events_address)
        self._send_lock = threading.Lock()
        self._requests = self._control = None
        if control_address is not None:
            assert rank is not None
            self._requests = self._dealer(control_address, rank_identity(rank))
            self._control = self._dealer(control_address, rank_identity(rank, control=True))
        self._closed = False

    def _dealer(self, address: str, identity: bytes) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.ROUTING_ID, identity)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return socket

    def send_event(self, message: Any) -> None:
        frames = self._signer.pack(message)
        with self._send_lock:
            if not self._closed:
                self._events.send_multipart(frames, copy=False)

    def receive_request(self, timeout_ms: int) -> Any | None:
        """Called only from the rank's main thread."""
        return self._receive(self._requests, timeout_ms)

    def receive_control(self, timeout_ms: int) -> Any | None:
        """Called only from the rank's control thread."""
        return self._receive(self._control, timeout_ms)

    def _receive(self, socket: zmq.Socket | None, timeout_ms: int) -> Any | None:
        assert socket is not None
        if not socket.poll(timeout_ms):
            return None
        return self._signer.unpack(socket.recv_multipart())

    def close(self) -> None:
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
        for socket in (self._requests, self._control):
            if socket is not None:
                socket.close()
        self._events.close()
        self._context.term()
