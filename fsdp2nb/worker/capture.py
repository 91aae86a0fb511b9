"""Capture a rank's stdout/stderr at the file-descriptor level and stream it out live.

Writes to fd 1 and 2 (Python's print, `os.write`, C extensions) go into pipes; one reader
thread per pipe forwards decoded text and tees raw bytes into the rank's log file. `begin_sync()`
writes a marker through the pipe and `end_sync()` waits for the reader to see it: after that, everything
written before the call has been forwarded, so a `CellFinished` can never overtake its output.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import secrets
import select
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from fsdp2nb.host.sigint import sigint_deferred

_READ_SIZE = 1 << 16


class LogSink(Protocol):
    """Where captured bytes are teed: the rank's rotating log (host/rank_logs.py), or any binary file."""

    def write(self, data: bytes, /) -> int | None: ...


class FdCapture:
    """Redirects one file descriptor into a pipe drained by a forwarding thread."""

    def __init__(self, fd: int, on_text: Callable[[str], None], log: LogSink,
                 pipe: tuple[int, int] | None = None) -> None:
        self._fd = fd
        self._on_text = on_text
        self._log = log
        self._marker = b"\x00fsdp2nb-sync-" + secrets.token_hex(8).encode() + b"\x00"
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._sync_lock = threading.Lock()
        self._seen = threading.Condition()
        self._markers_seen = 0
        self._markers_sent = 0
        # A pipe made by the host agent lets it recover what this rank wrote just before dying.
        read_end, write_end = pipe or os.pipe()
        self._read_end = read_end
        # A second write end of our own: markers go through it, and a cell that closes `fd`
        # (os.close(1)) neither ends the forwarding (no EOF) nor breaks a sync (EBADF).
        self._write_end = write_end
        self._busy = False
        os.dup2(write_end, fd)
        self._thread = threading.Thread(target=self._forward, args=(read_end,), daemon=True,
                                        name=f"fsdp2nb-capture-{fd}")
        self._thread.start()

    def begin_sync(self) -> int:
        """Write a marker after everything written so far; `end_sync` waits until it is seen."""
        with self._sync_lock, sigint_deferred():
            os.write(self._write_end, self._marker)
            self._markers_sent += 1
            return self._markers_sent

    def reopen_if_closed(self) -> None:
        """Point `fd` at the pipe again if user code closed it, and say so in the output."""
        try:
            os.fstat(self._fd)
            return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.dup2(self._write_end, self._fd)
            name = {1: "stdout", 2: "stderr"}.get(self._fd, "")
            os.write(self._write_end, f"fd {self._fd} ({name}) was closed by the cell; it was reopened "
                                      "so that output keeps reaching the notebook\n".encode())

    def end_sync(self, target: int, timeout_s: float = 10.0) -> None:
        with self._seen:
            self._seen.wait_for(lambda: self._markers_seen >= target, timeout_s)

    def _forward(self, read_end: int) -> None:
        pending = b""
        while True:
            select.select([read_end], [], [])
            self._busy = True
            data = os.read(read_end, _READ_SIZE)
            if not data:
                self._emit(pending)
                return
            pending = self._split_markers(pending + data)
            self._busy = bool(pending)

    def _split_markers(self, buffer: bytes) -> bytes:
        """Forward text up to each marker, acknowledge it, and keep a possible partial marker."""
        while (index := buffer.find(self._marker)) >= 0:
            self._emit(buffer[:index])
            buffer = buffer[index + len(self._marker):]
            with self._seen:
                self._markers_seen += 1
                self._seen.notify_all()
        keep = _partial_marker_length(buffer, self._marker)
        self._emit(buffer[: len(buffer) - keep])
        return buffer[len(buffer) - keep:]

    def _emit(self, data: bytes) -> None:
        """Log and forward; neither a full disk nor a lost kernel may stop the draining, or the
        rank would block on its next print with a full pipe."""
        if not data:
            return
        with contextlib.suppress(OSError):
            self._log.write(data)
        text = self._decoder.decode(data)
        if text:
            with contextlib.suppress(OSError):
                self._on_text(text)


class OutputSync:
    """Makes sure everything written to the captured descriptors so far has been forwarded.

    A reader marks itself busy before it takes bytes out of its pipe and clears the mark after
    forwarding them, so "pipe empty and reader not busy" means everything is through: an empty
    cell needs no marker round trip, and one poll tells which pipes still hold bytes.
    """

    def __init__(self, captures: Iterable[FdCapture], streams: PartialLineFlusher | None = None) -> None:
        self._streams = streams
        self._captures = {capture._read_end: capture for capture in captures}
        self._poller = select.poll()
        self._poller_lock = threading.Lock()  # a display() from any thread syncs too, and one
        for read_end in self._captures:      # poll object refuses two threads at once
            self._poller.register(read_end, select.POLLIN)

    def sync(self) -> None:
        for capture in self._captures.values():
            capture.reopen_if_closed()
        if self._streams is not None:
            self._streams.flush_now()  # a partial line still in Python's buffer
        with self._poller_lock:
            holding = {fd for fd, _ in self._poller.poll(0)}
        # Markers into every pipe first, then the waits: the pipes drain in parallel.
        targets = [(capture, capture.begin_sync()) for read_end, capture in self._captures.items()
                   if read_end in holding or capture._busy]
        for capture, target in targets:
            capture.end_sync(target)


def _partial_marker_length(buffer: bytes, marker: bytes) -> int:
    """Length of the longest tail of `buffer` that could be the start of `marker`.

    The marker's first byte (NUL) occurs inside it only at its ends, so only the last NUL in the
    tail can begin a partial marker.
    """
    start = buffer.rfind(marker[:1], max(0, len(buffer) - len(marker) + 1))
    if start >= 0 and marker.startswith(buffer[start:]):
        return len(buffer) - start
    return 0


PARTIAL_LINE_DELAY_S = 0.05


class LineStream(io.TextIOWrapper):
    """sys.stdout/sys.stderr of a rank: one write per line, partial lines soon after.

    `print("loss", x)` makes four writes; written through one by one they can reach the notebook
    in pieces and be shown as broken lines. Line buffering joins them into one write per line,
    and text without a newline (`print(x, end="")`) is flushed by a timer a moment later.
    """

    def __init__(self, fd: int, flusher: PartialLineFlusher) -> None:
        raw = io.FileIO(fd, "w", closefd=False)
        super().__init__(io.BufferedWriter(raw), encoding="utf-8", errors="replace", line_buffering=True)
        self._flusher = flusher

    def write(self, text: str) -> int:
        written = super().write(text)
        if "\n" not in text and "\r" not in text:  # line buffering flushed the others already
            self._flusher.schedule()
        return written


class PartialLineFlusher:
    """Flushes the rank's streams shortly after a partial line; sleeps while nothing is pending."""

    def __init__(self) -> None:
        self.streams: list[io.TextIOBase] = []
        self._pending = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="fsdp2nb-partial-lines").start()

    def schedule(self) -> None:
        self._pending.set()

    def flush_now(self) -> None:
        for stream in self.streams:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()

    def _run(self) -> None:
        while True:
            self._pending.wait()
            time.sleep(PARTIAL_LINE_DELAY_S)
            self._pending.clear()
            self.flush_now()


def line_buffered_streams() -> PartialLineFlusher:
    """Point sys.stdout/sys.stderr at fd 1/2, line-buffered; returns what flushes them."""
    flusher = PartialLineFlusher()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = LineStream(fd, flusher)
        flusher.streams.append(stream)
        setattr(sys, name, stream)
    return flusher


def drain_pipe(read_end: int) -> bytes:
    """Whatever is still buffered in a pipe, without blocking (used after its writer died)."""
    os.set_blocking(read_end, False)
    chunks = []
    while True:
        try:
            chunk = os.read(read_end, _READ_SIZE)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)
