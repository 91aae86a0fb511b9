"""Every error fsdp2nb raises derives from `Fsdp2nbError`; user code catches them as `fsdp2nb.Fsdp2nbError`.

Two kinds matter to the notebook:
- `UsageMistake` (a ValueError): what was asked cannot be done as asked and nothing changed; the
  message says why and what to do in one line. The magics show it as IPython's `UsageError`,
  without a traceback. `InvalidValue` is the one a config or an option raises for a value
  outside what it allows.
- anything else is a failure or a bug, shown with its traceback (a rank's, through `RankError`).

A class raised for a user's input or call derives from the builtin that was raised for it before
as well (`NoProcessGroup` is a RuntimeError, `ModelNotFound` a FileNotFoundError), so code that
caught the builtin still catches it. Internal invariants raise builtins, marked `# internal:` on
the line; tests/unit/test_error_raises.py fails on any other builtin raised in the package.

This module holds the errors that user code may catch and those raised in more than one part of
the package. An exception private to one module (a control-flow signal such as the kernel's
`PromptDeferred`, a launcher's own `RayLaunchError`) is defined beside its use and derives from
one of these. Nothing here imports torch or any other part of fsdp2nb, so every package can
import it.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsdp2nb.wire.records import ErrorInfo


class Fsdp2nbError(Exception):
    """The base of every error fsdp2nb raises."""


class UsageMistake(Fsdp2nbError, ValueError):
    """A request that cannot be done as asked; nothing changed, and the one-line message says
    what to do. The magics show it as IPython's UsageError, without a traceback."""


class InvalidValue(UsageMistake):
    """A config field or an option given a value it does not allow; the message names the field,
    the value and what is allowed."""


class NotReady(Fsdp2nbError, RuntimeError):
    """A call made before what it needs exists (a process group, something tracked, a dashboard
    shown) or after it ended (a closed checkpointer); nothing changed, and the one-line message
    says what to do first. A RuntimeError, as it was before it had a class of its own."""


class NoProcessGroup(NotReady, ValueError):
    """A function that runs on the ranks (`load_model`, `hsdp_mesh`, `FSDP2Engine`) called where
    no process group is initialised: in the notebook rather than in a `%%fsdp2` cell. A ValueError
    too, as torch's own error for it was before."""


class NotSupported(Fsdp2nbError, NotImplementedError):
    """A model, adapter or setting that fsdp2nb cannot handle the way asked (DoRA merged on export,
    a model whose `_init_weights` rewrites loaded weights); the message says what to use instead."""


class ModelNotFound(Fsdp2nbError, FileNotFoundError):
    """A model path that is not a directory of Hugging Face weights; the message names the path
    and what it should hold."""


class CheckpointNotFound(Fsdp2nbError, FileNotFoundError):
    """A checkpoint step or directory named that does not exist."""


class UnsafeDirectory(Fsdp2nbError, PermissionError, RuntimeError):
    """A directory fsdp2nb keeps private files in (its runtime directory, a kept pool's) that
    another user owns, or that is a link; the message says what to remove."""


# --- the pool, as the notebook's commands see it (kernel side) -------------------------------------


class PoolMismatchError(UsageMistake):
    """A cell asks for a pool other than the running one (other devices, or a kept pool where
    the running one is not kept)."""


class PoolAlreadyRunning(UsageMistake):
    """A start or an attach while this kernel runs a pool already."""


class NoPoolRunning(UsageMistake):
    """A command that needs the pool (restart, detach, push, pull, ...) while none runs."""


class PoolBroken(UsageMistake):
    """The pool can run no more cells (a rank died, a collective timed out, its host agent
    ended) and was not replaced; `%fsdp2 restart` starts a fresh one."""


class KeepRefused(UsageMistake):
    """`--keep` asked of a pool that cannot outlive its kernel (a Slurm step)."""


class PoolNotKept(UsageMistake):
    """`%fsdp2 detach` of a pool that is not kept: it ends with its kernel."""


class BackgroundRunActive(UsageMistake):
    """A command that must wait for this kernel's background run to end first."""


class NoSuchRun(UsageMistake):
    """`%fsdp2 wait` or `interrupt` names a background run that does not exist."""


class NothingToDebug(UsageMistake):
    """`%fsdp2 debug` with no failed cell (or a rank outside the pool) to open."""


class PoolStartError(Fsdp2nbError, RuntimeError):
    """The ranks did not all come up; the message carries what the failing rank printed."""


class LaunchError(Fsdp2nbError, RuntimeError):
    """The engine could not start the ranks (no Ray cluster, no srun, too few hosts); one line says why."""


# --- kept pools ---------------------------------------------------------------------------------


class NoSuchPool(UsageMistake):
    """No kept pool of this user has the name given (or none exists, or its agent ended)."""


class PoolNameNeeded(UsageMistake):
    """`%fsdp2 attach` without a name while several kept pools exist."""


class PoolNameTaken(UsageMistake):
    """`--keep --name NAME` where a live kept pool (or one being started) has that name."""


class PoolHeldError(UsageMistake):
    """Another live kernel holds the kept pool; the message says which and how to take it."""


class KeptPoolUnreadable(UsageMistake):
    """A kept pool's key cannot be trusted or does not verify its attach record: it cannot be attached."""


class AttachFailed(UsageMistake):
    """The ranks of a kept pool did not answer the kernel that attached; the pool is let go again."""


class WireVersionMismatch(UsageMistake):
    """The two ends speak different versions of the wire protocol (a kept pool started by another
    fsdp2nb, or ranks on a host with another install); the message names both and what to do."""


# --- the ranks ----------------------------------------------------------------------------------


class RankError(Fsdp2nbError):
    """One or more ranks raised; IPython shows each distinct traceback once, root cause first."""

    def __init__(self, errors: list[tuple[int, ErrorInfo]], world_size: int, notes: tuple[str, ...] = ()) -> None:
        self.errors = errors
        self.world_size = world_size
        self.notes = notes
        first_rank, first = errors[0]
        super().__init__(f"rank {first_rank} raised {first.ename}: {first.evalue}")

    def grouped(self) -> list[tuple[list[int], ErrorInfo]]:
        """Distinct tracebacks in the order they were first reported, with the ranks that raised each."""
        groups: dict[tuple, tuple[list[int], ErrorInfo]] = {}
        for rank, error in self.errors:
            key = (error.ename, error.evalue, _without_cell_numbers(error.traceback))
            groups.setdefault(key, ([], error))[0].append(rank)
        return list(groups.values())

    def _render_traceback_(self) -> list[str]:
        if _rank_error_renderer is not None:
            return _rank_error_renderer(self)
        return [str(self), *(line for _, error in self.errors for line in error.traceback), *self.notes]


_rank_error_renderer: Callable[[RankError], list[str]] | None = None


def set_rank_error_renderer(render: Callable[[RankError], list[str]]) -> None:
    """How IPython draws a RankError: `frontend/errors.py` sets it when the kernel imports it, so
    that this module, which every part imports, imports no part itself."""
    global _rank_error_renderer
    _rank_error_renderer = render


def _without_cell_numbers(traceback_lines: tuple[str, ...]) -> tuple[str, ...]:
    # Ranks number their cells alike, but a rank that joined later would differ: ignore `In[n]`.
    return tuple(re.sub(r"In\[\d+\]", "In[]", line) for line in traceback_lines)


class UnknownRequest(Fsdp2nbError, TypeError):
    """A rank was sent a message it does not run (a request or command of another fsdp2nb, or a bug)."""


class FailedElsewhere(Fsdp2nbError, RuntimeError):
    """Another rank failed at a step this rank took part in."""


class InputUnavailable(Fsdp2nbError, RuntimeError):
    """No one can answer the prompt (a frontend without stdin, a background run, a rank's own
    thread). Shown as its one line: the rank's traceback through pdb would only hide it."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class WrongTrainerClass(UsageMistake):
    """A model handed to a Trainer class that cannot train it as it is sharded; a rank shows the
    message alone, as a usage mistake, since the traceback adds nothing to it."""


# --- checkpoints --------------------------------------------------------------------------------


class CheckpointSaveError(Fsdp2nbError, RuntimeError):
    """A save failed (possibly in the background); raised at the next call of the checkpointer."""


class SaveFilesMissing(CheckpointSaveError, FileNotFoundError):
    """Rank 0 came to commit a save and found other ranks' files missing: the checkpoint directory
    is not one directory shared by every host, or something removed them. LATEST is left as it was."""


class CheckpointLoadError(UsageMistake):
    """A load was refused before it changed anything: no such step, or a damaged one. Every rank
    raises it with the same message."""


class MemorySnapshotRefused(UsageMistake):
    """A snapshot in host memory was refused before anything was copied: the host has no room
    for it, or (restoring) it was taken of another model, world size or mesh. Every rank raises it."""


class CheckpointMismatchError(Fsdp2nbError, ValueError):
    """A checkpoint's keys or shapes do not match the model (or optimizer) being loaded into."""


class MissingWeights(CheckpointMismatchError, KeyError):
    """Model keys that the checkpoint has no tensor for (a KeyError too, as it was before)."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # the message as written, not quoted as a KeyError's key


class NoTrackedCheckpointer(Fsdp2nbError, RuntimeError):
    """`%fsdp2 save` or `load` ran before any Checkpointer called `track()`; the notebook shows
    this error's message alone, as a usage mistake."""


def forget_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames of `error` and of its causes; its
    traceback still reads as before. For an error kept after what raised it is gone (a save
    thread's, a released collective's), whose frames would keep tensors and connections alive."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        traceback.clear_frames(link.__traceback__)
        link = link.__cause__ or link.__context__
