"""What memory this host lets a process have, and whether the kernel's OOM killer has struck (no torch).

A container's limit is its memory cgroup's, not the machine's RAM: `psutil` sees the machine.
cgroup v2 keeps the limit in `memory.max` and counts OOM kills in `memory.events` (`oom_kill`,
this cgroup and those below it); cgroup v1 keeps the limit in `memory.limit_in_bytes` and the
count in `memory.oom_control`. Everything here reads files and returns None where they are
missing or unreadable, so callers say "unknown" rather than fail.
"""

from __future__ import annotations

import os
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def cgroup_memory_dir(proc_cgroup: str = "/proc/self/cgroup", root: Path = _CGROUP_ROOT) -> Path | None:
    """The memory cgroup directory this process belongs to (v2's unified one, else v1's memory one)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: "0::/some/path"
            candidate = root / path.lstrip("/")
        elif "memory" in controllers.split(","):
            candidate = root / "memory" / path.lstrip("/")
        else:
            continue
        # Inside a container the path may be the host's view: fall back to the mount's root.
        for directory in (candidate, root if hierarchy == "0" else root / "memory"):
            if (directory / "memory.max").is_file() or (directory / "memory.limit_in_bytes").is_file():
                return directory
    return None


def cgroup_limit_bytes(directory: Path | None = None) -> int | None:
    """The memory cgroup's limit in bytes; None without a limit or a readable cgroup."""
    directory = directory or cgroup_memory_dir()
    if directory is None:
        return None
    for name in ("memory.max", "memory.limit_in_bytes"):
        text = _read(directory / name)
        if text is not None:
            if text == "max" or not text.isdigit() or int(text) >= _NO_LIMIT:
                return None
            return int(text)
    return None


def host_limit_bytes() -> int:
    """Memory the processes of this host may use: the machine's RAM, or its cgroup's limit if lower."""
    import psutil

    total = psutil.virtual_memory().total
    limit = cgroup_limit_bytes()
    return min(total, limit) if limit else total


def available_bytes(proc_cgroup: str = "/proc/self/cgroup", root: Path = _CGROUP_ROOT) -> int:
    """Memory free for a new allocation now: the machine's available RAM, or what the cgroup has
    left if less (its limit less its usage, the page cache it could drop counted as free, as the
    machine's MemAvailable counts it)."""
    import psutil

    available = psutil.virtual_memory().available
    directory = cgroup_memory_dir(proc_cgroup, root)
    limit = cgroup_limit_bytes(directory)
    if directory is None or limit is None:
        return available
    used = _read(directory / "memory.current") or _read(directory / "memory.usage_in_bytes")
    if used is None or not used.isdigit():
        return available
    return max(0, min(available, limit - int(used) + _reclaimable_cache_bytes(directory)))


def _reclaimable_cache_bytes(directory: Path) -> int:
    """The cgroup's inactive file cache (v2 `inactive_file`, v1 `total_inactive_file`), which the
    kernel drops before it OOM-kills; 0 where unknown."""
    for line in (_read(directory / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
            return int(value)
    return 0


def oom_kill_count(directory: Path | None = None) -> int | None:
    """How many processes the OOM killer has killed in this memory cgroup; None where unreadable."""
    directory = directory or cgroup_memory_dir()
    if directory is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        text = _read(directory / name)
        if text is None:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def kernel_log_names_oom_kill(pid: int, kmsg: str = "/dev/kmsg") -> bool | None:
    """Whether the kernel log says the OOM killer killed `pid`: True, False, or None where the log
    cannot be read (most containers)."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    needles = (f"Killed process {pid} ", f",pid={pid},")
    found = False
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the log
            except OSError:  # EPIPE: a record was overwritten while reading; go on with the next
                continue
            if not record:
                break
            text = record.decode("utf-8", "replace")
            if "oom" in text.lower() or "Killed process" in text:
                found = found or any(needle in text for needle in needles)
    finally:
        os.close(fd)
    return found


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
