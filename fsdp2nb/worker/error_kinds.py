"""What kind of failure ended a rank's request, decided from the exception itself.

The kernel acts on the kind: a collective failure means the process groups must be re-formed
before the next cell, anything else is the user's to fix and the pool goes on as it is. The kind
comes from the exception's type and where it was raised, never from the words of its message: a
user's `raise RuntimeError("timed out")` is the user's error.
"""

from __future__ import annotations

import os
from types import TracebackType

from fsdp2nb.wire.records import ErrorKind

_TORCH_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def error_kind(error: BaseException, *, released: bool) -> ErrorKind:
    """`released`: the kernel cut this rank's collectives during the request."""
    collective = any(_is_collective_failure(link) for link in _chain(error))
    if released and collective:  # the stop button may land while the released collective unwinds
        return "released"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return "collective" if collective else "raised"


def _chain(error: BaseException) -> list[BaseException]:
    """The error and its causes and contexts (a user's `raise ... from` keeps the collective's)."""
    seen: list[BaseException] = []
    while error is not None and all(error is not other for other in seen):
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def _is_collective_failure(error: BaseException) -> bool:
    """torch.distributed's own error types, or a RuntimeError raised inside torch.distributed
    (gloo reports timeouts and lost peers as RuntimeError from the wait on a collective)."""
    try:
        from torch.distributed import DistError
    except ImportError:  # torch without distributed support: nothing is a collective
        return False
    if isinstance(error, DistError):
        return True
    return type(error) is RuntimeError and _raised_in_torch_distributed(error.__traceback__)


def _raised_in_torch_distributed(tb: TracebackType | None) -> bool:
    innermost = None
    while tb is not None:
        innermost, tb = tb, tb.tb_next
    return innermost is not None and _TORCH_DISTRIBUTED in innermost.tb_frame.f_code.co_filename
