"""Replace a directory with one built beside it, in one step, keeping the files it does not replace.

The new content is written into a hidden staging directory next to the target, made durable, and
exchanged with the target by `renameat2(RENAME_EXCHANGE)`: a reader sees the old directory or the
new one, never a mix, and a crash at any point leaves one of them whole. Where the exchange is not
supported the old directory is moved aside first, and the next `start_staging` puts it back if a
crash came between the two renames. Entries of the old directory that the caller's `carry`
accepts are brought over (hard links, no data copied), with the directory's permissions.

A mount point cannot be renamed, nor can a directory whose parent is not writable take a sibling:
there the staging directory goes inside the target and its entries are moved in one by one, which
is not atomic (a crash while moving can leave a mix).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from fsdp2nb.checkpoint.layout import fsync_dir, fsync_file

logger = logging.getLogger(__name__)

_INSIDE_NAME = ".export-new"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2

Exchange = Callable[[Path, Path], bool]
"""Swap two paths in one step; False where the system cannot (then two renames are used)."""


def staging_paths(target: Path, *, inside: bool | None = None) -> tuple[Path, Path]:
    """(where new content is staged, where the old directory waits during a two-rename swap).
    `inside`: stage inside the target; None decides (inside a mount point)."""
    if inside is None:
        inside = is_mount(target)
    if inside:
        return target / _INSIDE_NAME, target / ".export-old"
    return target.with_name(f".{target.name}.export-new"), target.with_name(f".{target.name}.export-old")


def start_staging(target: Path, *, inside: bool | None = None) -> Path:
    """An empty staging directory for `target`, after undoing what an interrupted swap left.
    Beside the target where its parent takes one, else inside it."""
    staging, aside = staging_paths(target, inside=inside)
    if aside.exists() and not target.exists():
        logger.warning("restoring %s: an earlier replacement stopped between its two renames", target)
        os.rename(aside, target)
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not target.is_dir():
            raise
        staging = target / _INSIDE_NAME  # the parent is not ours to write: stage inside
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    return staging


def commit_staging(staging: Path, target: Path, *, carry: Callable[[str], bool],
                   exchange: Exchange | None = None) -> None:
    """Make `staging` durable and put it in place of `target`. Entries of the old target whose
    names `carry` accepts, and that the staging lacks, are kept; the others are dropped."""
    inside = staging.parent == target
    if target.is_dir() and not inside:
        _carry_entries(target, staging, carry)
        _copy_directory_attributes(target, staging)
    _fsync_tree(staging)
    if inside:
        _move_into(staging, target, carry)
    elif target.exists():
        _swap(staging, target, exchange or exchange_paths)
    else:
        os.rename(staging, target)
    fsync_dir(target.parent)


def is_mount(path: Path) -> bool:
    """A mount point, bind mounts of the same file system included (which os.path.ismount misses)."""
    if os.path.ismount(path):
        return True
    try:
        with open("/proc/self/mountinfo") as mounts:
            points = {unescape_mount_path(fields[4]) for fields in map(str.split, mounts) if len(fields) > 4}
    except OSError:
        return False
    return str(path) in points


def unescape_mount_path(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash in a path as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), text)


def exchange_paths(first: Path, second: Path) -> bool:
    """renameat2(RENAME_EXCHANGE): swap two paths atomically; False where it is not supported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))  # internal: the system call's own failure, not bad input


def _fsync_tree(root: Path) -> None:
    directories = [root]
    for path in root.rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            directories.append(path)
        elif path.is_file():
            fsync_file(path)
    for directory in directories:
        fsync_dir(directory)


def _swap(staging: Path, target: Path, exchange: Exchange) -> None:
    if not exchange(staging, target):
        _, aside = staging_paths(target, inside=False)
        os.rename(target, aside)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(aside, target)  # the old directory back where it was
            raise
        staging = aside
    shutil.rmtree(staging, ignore_errors=True)  # the old content, after an exchange


def _move_into(staging: Path, target: Path, carry: Callable[[str], bool]) -> None:
    """Files are replaced one by one (a reader in between can see both versions), an index
    (`*.index.json`) last, then old entries neither replaced nor carried are removed."""
    logger.warning("%s cannot be renamed (a mount point, or its parent is not writable): its new content "
                   "is moved in file by file, not swapped in whole", target)
    new_names = {entry.name for entry in staging.iterdir()}
    for entry in sorted(staging.iterdir(), key=lambda e: e.name.endswith(".index.json")):
        destination = target / entry.name
        if destination.is_dir() and not destination.is_symlink():
            shutil.rmtree(destination)
        os.replace(entry, destination)
    for entry in target.iterdir():
        if entry == staging or entry.name in new_names or carry(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    staging.rmdir()
    fsync_dir(target)


def _carry_entries(old: Path, new: Path, carry: Callable[[str], bool]) -> None:
    for entry in old.iterdir():
        destination = new / entry.name
        if destination.exists() or not carry(entry.name):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), destination)
        elif entry.is_dir():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, destination)


def _copy_directory_attributes(old: Path, new: Path) -> None:
    """Permissions and group of the directory being replaced (a group-shared 2775 stays so)."""
    info = os.stat(old)
    shutil.copystat(old, new)
    try:
        os.chown(new, -1, info.st_gid)
    except PermissionError:
        pass  # not a member of that group: the directory keeps ours


def _link_or_copy(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """A hard link (no data copied, and the old directory is removed right after); a copy where refused."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
