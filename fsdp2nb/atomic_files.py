"""Replacing a file so that a reader sees the old content or the new, whole, never a mix (no torch).

The new content goes to a hidden temporary file beside the target (same filesystem, so the
rename is atomic), named with this process's id so that two writers never share one, and then
`os.replace` puts it in place. `private` makes it readable by this user only (signed records,
pool state); `durable` fsyncs the file and then its directory, for what must survive a power
cut (a checkpoint's `latest` pointer).
"""

from __future__ import annotations

import os
from pathlib import Path


def replace_atomically(path: str | os.PathLike, data: bytes, *, private: bool = False, durable: bool = False) -> None:
    """Replace `path` with `data`; see the module's docstring for `private` and `durable`."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if durable:
        directory_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory_fd)
        finally:
            os.close(directory_fd)
