"""Replacing a file so that a reader sees the old content or the new, whole, never a mix (no torch).

The new content goes to a hidden temporary file beside the target (same filesystem, so the
rename is atomic), under a random name opened exclusively and without following links, so that
two writers never share one and a link planted in a shared folder is never written through; then
`os.replace` puts it in place (`create_atomically`: `os.link`, which keeps a file another process
made first). `private` makes it readable by this user only (signed records, pool state, snapshot
stores); `durable` fsyncs the file and then its directory, for what must survive a power cut (a
checkpoint's `latest` pointer); `num_reserved_bytes` reserves room for a file that will be mapped
and filled later, so that a full tmpfs fails here rather than as a SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def replace_atomically(path: str | os.PathLike, data: bytes = b"", *, private: bool = False, durable: bool = False,
                       num_reserved_bytes: int = 0) -> None:
    """Replace `path` with `data`; see the module's docstring for the keywords."""
    target = Path(path)
    temporary = _written_beside(target, data, private=private, durable=durable, num_reserved_bytes=num_reserved_bytes)
    try:
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_directory(target.parent)


def create_atomically(path: str | os.PathLike, data: bytes = b"", *, private: bool = False,
                      num_reserved_bytes: int = 0) -> bool:
    """Make `path` whole with `data` unless it exists; False (theirs kept) where another process
    made it first."""
    target = Path(path)
    temporary = _written_beside(target, data, private=private, durable=False, num_reserved_bytes=num_reserved_bytes)
    try:
        os.link(temporary, target)
    except FileExistsError:
        return False
    finally:
        temporary.unlink(missing_ok=True)
    return True


def _written_beside(target: Path, data: bytes, *, private: bool, durable: bool, num_reserved_bytes: int) -> Path:
    """A new hidden file beside `target` holding `data` (and `num_reserved_bytes` reserved)."""
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            if num_reserved_bytes:
                os.posix_fallocate(out.fileno(), 0, num_reserved_bytes)
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _fsync_directory(directory: Path) -> None:
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
