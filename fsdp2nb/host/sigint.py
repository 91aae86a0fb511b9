"""SIGINT (the notebook's stop button) around code that must not be cut in the middle.

Two tools, for the main thread, where Python delivers SIGINT:
- `sigint_noted()`: while a request is sent and waited for, the kernel only counts presses and
  acts on them between its own steps;
- `sigint_deferred()`: a frame is written whole, the signal is delivered after it.
A process that owns its SIGINT handling (a rank) installs a `SigintGate`, which makes deferring
a counter instead of two handler swaps.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

try:
    import _signal as _c_signal  # the C module behind `signal`
except ImportError:  # another Python implementation
    _c_signal = signal


class SigintNotes:
    """Stands in for the SIGINT handler: counts presses of the stop button instead of raising."""

    def __init__(self) -> None:
        self.previous: object = None
        """The handler this one replaced (what signal.signal returned)."""
        self._count = 0

    def __call__(self, signum: int, frame) -> None:  # a frame or None
        self._count += 1

    def take(self) -> bool:
        """Whether SIGINT came since the last call."""
        came, self._count = self._count > 0, 0
        return came


_active_notes: SigintNotes | None = None  # main thread only


@contextlib.contextmanager
def sigint_noted():
    """While the block runs on the main thread, SIGINT (the stop button) only takes note.

    Yields the notes to poll with `take()`; None off the main thread, where SIGINT never lands.
    Inside an outer block, yields the outer notes. The Python-level handler is swapped rather
    than the signal masked: the OS hands a signal the main thread masks to another thread
    (ipykernel has several) and Python still raises on the main one at its next instruction.
    """
    global _active_notes
    if _active_notes is not None or threading.current_thread() is not threading.main_thread():
        yield _active_notes
        return
    notes = SigintNotes()
    notes.previous = _set_sigint_handler(notes)
    _active_notes = notes
    try:
        yield notes
    finally:
        _active_notes = None
        _set_sigint_handler(notes.previous)


LATE_PRESS_S = 1.0
"""After a cell the stop button ended, how long further presses still count as part of that stop."""


class _LatePresses:
    """SIGINT handler for the moment after an interrupted cell: a second press of a double press
    that lands once the wait has ended would raise KeyboardInterrupt wherever the kernel then is
    (showing the traceback, sending the reply: ipykernel then drops the reply and the notebook
    waits for ever). Presses until `until` are dropped; a later one goes to the handler before."""

    def __init__(self, previous, until: float) -> None:  # a signal handler
        self.previous = previous
        self.until = until

    def __call__(self, signum: int, frame) -> None:  # a frame or None
        if time.monotonic() < self.until:
            return
        _set_sigint_handler(self.previous)
        if callable(self.previous):
            self.previous(signum, frame)


def drop_late_presses(seconds: float = LATE_PRESS_S) -> None:
    """On the main thread, after a cell that the stop button ended: drop presses for `seconds`.
    ipykernel puts its own handler back once the request is answered, so this never reaches the
    next cell; elsewhere (a terminal) a press after `seconds` acts as before. Code that goes on in
    the same request (a loop of the user's that calls the magic and catches its error) has its
    presses dropped for that moment too. Called inside a `sigint_noted` block, it takes over from
    the block's end, which then puts this handler in place instead of the one before: no press
    falls between the two."""
    if threading.current_thread() is not threading.main_thread():
        return
    notes = _active_notes
    previous = notes.previous if notes is not None else _c_signal.getsignal(signal.SIGINT)
    if isinstance(previous, _LatePresses):
        previous = previous.previous
    if not callable(previous):  # SIG_IGN or SIG_DFL need nothing
        return
    late = _LatePresses(previous, time.monotonic() + seconds)
    if notes is not None:
        notes.previous = late
    else:
        _set_sigint_handler(late)


def _set_sigint_handler(handler):  # a signal handler
    """signal.signal for SIGINT without its wrapper's enum conversion of the old handler, which
    for a Python handler raises and catches a ValueError, twice per cell."""
    return _c_signal.signal(signal.SIGINT, handler)


class SigintGate:
    """A SIGINT handler that holds the signal back inside `sigint_deferred` blocks and passes it
    to `handler` otherwise. A process that installs one (the ranks do) spares every such block
    two handler swaps, which a rank would pay on each reply."""

    def __init__(self, handler) -> None:  # a signal handler
        self.handler = handler
        self._depth = 0
        self._pending = False

    def __call__(self, signum: int, frame) -> None:  # a frame or None
        if self._depth:
            self._pending = True
        else:
            self.handler(signum, frame)

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, error_type, error, traceback) -> None:
        self._depth -= 1
        if self._depth or not self._pending:
            return
        self._pending = False
        if error_type is None:  # a block that raised has ended what the signal would interrupt
            self.handler(signal.SIGINT, None)


_NOTHING_TO_DEFER = contextlib.nullcontext()


def sigint_deferred() -> contextlib.AbstractContextManager:
    """Hold back SIGINT on the main thread until the block is done, then deliver it.

    A KeyboardInterrupt between a frame's length and its bytes would leave a torn frame, and
    everything after it on that connection unreadable. Inside a `sigint_noted` block the
    press stays noted there for its owner to act on; a block that raised drops it (what it was
    doing has ended anyway).
    """
    if _active_notes is not None or threading.current_thread() is not threading.main_thread():
        return _NOTHING_TO_DEFER
    handler = _c_signal.getsignal(signal.SIGINT)  # as _set_sigint_handler: no enum conversion
    return handler if isinstance(handler, SigintGate) else _swapped_sigint_deferred()


@contextlib.contextmanager
def _swapped_sigint_deferred():
    with sigint_noted() as notes:
        yield
    if notes.take():
        _deliver_sigint(notes.previous)


def _deliver_sigint(handler) -> None:  # what signal.signal returned
    if callable(handler):
        handler(signal.SIGINT, None)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_raises():
    """Inside a `sigint_noted` block: while this block runs, the stop button raises
    KeyboardInterrupt again (ipykernel's wait for an input reply ends only so), then is noted."""
    notes = _active_notes
    if notes is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = notes.previous if callable(notes.previous) else signal.default_int_handler
    _set_sigint_handler(previous)
    try:
        yield
    finally:
        _set_sigint_handler(notes)
