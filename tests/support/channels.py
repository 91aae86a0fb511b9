"""Helpers for tests of the pool's channels (Unix sockets, and TCP with TLS): a log kept in a
list, and waiting for a condition or for messages from the kernel's end."""

from __future__ import annotations

import logging
import time


class ListLog(logging.Handler):
    """A log injected into the kernel's channels: its lines, kept in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.logger = logging.Logger("test-pool-log")
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def matching(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Whether `condition()` held within `timeout_s`, polled every 10 ms."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def read_until(kernel, condition, timeout_s: float = 10.0) -> list:
    """Messages the kernel end delivers (read on this thread, as the pool's reader does) until `condition`."""
    received: list = []
    deadline = time.monotonic() + timeout_s
    while not condition(received) and time.monotonic() < deadline:
        kernel.receive(50, received.append)
    return received
