"""A registry of running pools, so processes orphaned by a crashed kernel can be ended safely.

Each pool writes its owner (the kernel) and its processes as (pid, start time) pairs
(host/process_identity.py); so does a standby agent waiting for the next launch
(pool/launcher.py), under its own id. A pid alone could have been reused by an unrelated process;
the pair cannot, so only exact matches are killed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import psutil

from fsdp2nb.atomic_files import replace_atomically
from fsdp2nb.errors import UnsafeDirectory
from fsdp2nb.host import memory_store
from fsdp2nb.host.persisting import AGENT_GIVES_UP_WITHIN_S, persisting_bound, persisting_until
from fsdp2nb.host.process_identity import ProcessKey, is_same_process

logger = logging.getLogger(__name__)

LOG_RETENTION_S = 7 * 24 * 3600


def state_dir(temp_root: str | None = None) -> Path:
    """This user's private directory for pool registries and logs (0700), under `temp_root`
    (default: the system's temporary directory)."""
    path = Path(temp_root or tempfile.gettempdir()) / f"fsdp2nb-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    # In a shared /tmp another user could have made this name first (or a link by it).
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} is not a directory owned by this user; remove it (or set TMPDIR elsewhere) "
                              "and start the pool again")
    os.chmod(path, 0o700)
    return path


def _registry_dir() -> Path:
    path = state_dir() / "pools"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def record_pool(pool_id: str, owner: ProcessKey, processes: list[ProcessKey], runtime_dir: str = "") -> None:
    entry = {"owner": owner, "processes": processes, "runtime_dir": runtime_dir}
    replace_atomically(_registry_dir() / f"{pool_id}.json", json.dumps(entry).encode())


def forget_pool(pool_id: str) -> None:
    (_registry_dir() / f"{pool_id}.json").unlink(missing_ok=True)


def reap_orphans(spare_store: str = "", notes: list[str] | None = None) -> int:
    """Kill the processes of pools whose kernel is gone, and free snapshot stores nobody owns
    but `spare_store` (that of a kept pool being restarted); returns how many were killed.
    A line for the user goes to `notes` where it waited for ranks writing a snapshot first."""
    num_killed = 0
    for path in _registry_dir().glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        owner = (entry["owner"][0], entry["owner"][1])
        if is_alive(owner):
            continue
        waited_s = _wait_while_persisting(owner, [(pid, started) for pid, started in entry["processes"]])
        if waited_s is not None and notes is not None:
            notes.append(f"waited {waited_s:.1f} s for the ranks of kernel {owner[0]}, which ended, to write its "
                         f"newest snapshot to disk ({state_dir() / 'logs' / path.stem / 'pool.log'} says what)")
        for pid, started in entry["processes"]:
            num_killed += _kill_if_same((pid, started))
        if entry.get("runtime_dir"):
            shutil.rmtree(entry["runtime_dir"], ignore_errors=True)
        path.unlink(missing_ok=True)
    _prune_old_logs()
    _prune_standby_dirs()
    memory_store.sweep_stores(lambda pid, started: is_alive((pid, started)), spare=spare_store)
    return num_killed


_PERSIST_POLL_S = 0.1


def _wait_while_persisting(owner: ProcessKey, processes: list[ProcessKey]) -> float | None:
    """The ranks of a kernel that died may be writing its newest snapshot to disk (their agent
    marked its store: host/persisting.py): wait until they end, so that the new pool's
    `load("latest")` finds what they wrote. Once their time is up their agent ends them and logs
    why; only where it has not within `AGENT_GIVES_UP_WITHIN_S` are they killed here.
    Returns the seconds waited; None: no wait."""
    store = memory_store.session_store(*owner)
    until = persisting_until(store)
    if until is None or not any(map(is_alive, processes)):
        return None
    logger.info("waiting up to %.0f s for the ranks of kernel %d to write its snapshot to disk",
                until - time.time(), owner[0])
    started = time.monotonic()
    while any(map(is_alive, processes)) and time.time() < (persisting_bound(store) or 0) + AGENT_GIVES_UP_WITHIN_S:
        time.sleep(_PERSIST_POLL_S)
    return time.monotonic() - started


def _prune_old_logs(max_age_s: float = LOG_RETENTION_S) -> None:
    """Per-rank logs are kept for a week after their pool was made, and while it runs.

    A log directory's time changes only when a file is added, not when a rank writes to its
    log, so the pools still registered (reap_orphans has just removed the dead ones) are kept."""
    cutoff = time.time() - max_age_s
    running = {path.stem for path in _registry_dir().glob("*.json")} | _kept_pool_ids()
    for log_dir in (state_dir() / "logs").glob("*"):
        if log_dir.name in running:
            continue
        try:
            if log_dir.stat().st_mtime < cutoff:
                shutil.rmtree(log_dir, ignore_errors=True)
        except OSError:
            continue


def _kept_pool_ids() -> set[str]:
    """Kept pools (pool/kept/holder.py) are in no registry: their logs are kept while they run."""
    ids = set()
    for meta in (state_dir() / "kept").glob("*/pool.json"):
        try:
            ids.add(json.loads(meta.read_text())["pool_id"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return ids


def _prune_standby_dirs(min_age_s: float = 60.0) -> None:
    """A standby agent's output directory (pool/launcher.py) is registered while it waits and
    removed by the agent once a plan names the pool's log. One left unregistered is that of an
    agent that died between taking its plan and reading it: removed after `min_age_s`."""
    registered = {path.stem for path in _registry_dir().glob("*.json")}
    cutoff = time.time() - min_age_s
    for directory in (state_dir() / "standby").glob("standby-*"):
        try:
            if directory.name not in registered and directory.stat().st_mtime < cutoff:
                shutil.rmtree(directory, ignore_errors=True)
        except OSError:
            continue


def running_process(key: ProcessKey) -> psutil.Process | None:
    """The process of `key` (pid, start time) while it runs: not ended, not a zombie."""
    if not is_same_process(key):
        return None
    try:  # a zombie has ended already; it waits only for its parent to collect its status
        process = psutil.Process(key[0])
        return process if process.status() != psutil.STATUS_ZOMBIE else None
    except psutil.Error:
        return None


def is_alive(key: ProcessKey) -> bool:
    return running_process(key) is not None


def _kill_if_same(key: ProcessKey) -> int:
    process = running_process(key)
    if process is None:
        return 0
    try:
        process.kill()
    except psutil.Error:
        return 0
    logger.warning("ended orphaned fsdp2nb process %d", key[0])
    return 1
