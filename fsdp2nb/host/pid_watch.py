"""Waking a poll() when a process ends, through a pidfd: how the host agent waits for its kernel
(worker/agent.py) and a kept Ray pool's driver for the kernel that holds it (pool/kept/on_ray.py)."""

from __future__ import annotations

import os
import select


class PidWatch:
    """A pidfd of the watched process, registered with `poller` (readable once the process has
    ended) and replaced when another process is to be watched."""

    def __init__(self, poller: select.poll) -> None:
        self._poller = poller
        self.fd: int | None = None
        """The pidfd, while a process is watched: poll() reports it once that process ended."""

    def watch(self, pid: int | None) -> bool:
        """Watch `pid` instead of the process watched so far (None: none). False where it cannot
        be watched: it has ended already, or the OS has no pidfd_open (before Linux 5.3)."""
        self.close()
        if pid is None:
            return True
        try:
            self.fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return False
        self._poller.register(self.fd, select.POLLIN)
        return True

    def ended(self) -> bool:
        """Whether the watched process has ended, without waiting."""
        if self.fd is None:
            return False
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        """Watch nothing; safe to call twice."""
        if self.fd is not None:
            self._poller.unregister(self.fd)
            os.close(self.fd)
            self.fd = None
