"""Collective helpers that checkpoint, engine and worker share.

Failures that every rank hears about: one rank that raised alone would leave the others
waiting at their next collective, so each step that can fail on some ranks ends in agreement.
Every rank raises; the rank that failed raises its own error, the others one that names the
failing rank and its cause. Collective: every rank of `group` must call, in the same order.

Each helper also works in a single process without a process group, as one rank of one.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from fsdp2nb.errors import FailedElsewhere

# torch 2.13 names it all_gather_single and warns on every call of the old name, in the user's cell.
_ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_T = TypeVar("_T")


COLLECTIVE_TIMEOUT_ENV = "FSDP2NB_COLLECTIVE_TIMEOUT_S"
"""Set on a pool's ranks to the default group's timeout (`--timeout`)."""


def new_gloo_group() -> dist.ProcessGroup:
    """A CPU group of every rank, with the pool's collective timeout: a group made with torch's
    default would wait 30 minutes for a rank that `--timeout` says is gone after a few seconds.
    On CPU ranks it has the default group's backend (re-formable after a failed collective,
    `worker.reformable_groups`); beside NCCL it is plain gloo."""
    timeout_s = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    timeout = timedelta(seconds=float(timeout_s)) if timeout_s else None
    default_backend = dist.get_backend()
    backend = "gloo" if "nccl" in default_backend else default_backend
    return dist.new_group(backend=backend, timeout=timeout)


def is_distributed() -> bool:
    """Whether this process is a rank of an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The number of ranks; 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def all_gathered(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's `tensor` (one shape and dtype on every rank) stacked in rank order:
    (world size, *shape); without a process group, `tensor[None]`.

    Among more than two CPU ranks the tensor goes to the group's first rank in one gather and comes
    back in one broadcast: every rank sends or receives at once, twice. gloo's all_gather and
    all_reduce pass a ring instead, world size - 1 steps one after another, each waiting for the
    next rank's process to be scheduled, which costs milliseconds per step where ranks share few
    cores (`benchmarks/bench_exchanges.py`). Two ranks, and other devices (NCCL), take one
    all-gather into a tensor."""
    if not is_distributed():
        return tensor[None]
    world_size = dist.get_world_size(group)
    stacked = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    if tensor.device.type != "cpu" or world_size <= 2:
        _ALL_GATHER_INTO_TENSOR(stacked.view(-1), tensor.reshape(-1), group=group)  # gloo takes flat ones
        return stacked
    first = dist.get_global_rank(group, 0) if group is not None else 0
    rows = list(stacked.unbind()) if dist.get_rank() == first else None
    dist.gather(tensor.contiguous(), rows, dst=first, group=group)
    dist.broadcast(stacked, src=first, group=group)
    return stacked


def all_gathered_objects(value: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's picklable `value`, in rank order, as `dist.all_gather_object` gives them; on a
    CPU group through `all_gathered` (the sizes, then the bytes padded to the longest)."""
    if not is_distributed():
        return [value]
    if "nccl" in str(dist.get_backend(group)):
        values: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(values, value, group=group)
        return values
    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    sizes = all_gathered(torch.tensor([payload.numel()]), group)[:, 0].tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:payload.numel()] = payload
    rows = all_gathered(padded, group)
    return [pickle.loads(row[:size].numpy().tobytes()) for row, size in zip(rows, sizes, strict=True)]


def all_max(values: tuple[int, ...], group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """The largest of each value over the ranks of `group`, in one collective; without a process
    group, `values`.

    A CPU tensor, so a gloo group carries it; the minimum of x is `-all_max(-x)`."""
    if not is_distributed():
        return tuple(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tuple(tensor.tolist())


class PostedMax:
    """An `all_max` posted without waiting for it (`post_all_max`); `wait()` gives its result.
    Every rank must wait for it (or the group's next collective waits behind it)."""

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None) -> None:
        self._tensor, self._work = tensor, work

    def wait(self) -> tuple[int, ...]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return tuple(self._tensor.tolist())


def post_all_max(values: tuple[int, ...], group: dist.ProcessGroup | None = None) -> PostedMax:
    """`all_max` that returns at once: the ranks exchange while this rank goes on working. Without
    a process group the result is `values`."""
    tensor = torch.tensor(values, dtype=torch.int64)
    if not is_distributed():
        return PostedMax(tensor, None)
    return PostedMax(tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True))


def all_ranks_succeeded(error: BaseException | None, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if `error` is set on any: its own error where it failed, else
    FailedElsewhere("`what` failed on rank R: cause")."""
    gathered_if_all_succeeded(None, error, what, group)


def gathered_if_all_succeeded(value: _T, error: BaseException | None, what: str,
                              group: dist.ProcessGroup | None = None) -> list[_T]:
    """Every rank's `value`, in rank order, when no rank has an `error`; else raise on every rank as
    `all_ranks_succeeded` does. One exchange for both the agreement and the values."""
    outcome = (None if error is None else describe(error), None if error is not None else value)
    outcomes = all_gathered_objects(outcome, group)
    if error is not None:
        raise error
    failed = [(rank, reason) for rank, (reason, _) in enumerate(outcomes) if reason is not None]
    if failed:
        rank, text = failed[0]
        source = dist.get_global_rank(group, rank) if group is not None else rank
        raise FailedElsewhere(f"{what} failed on rank {source}: {text}")
    return [entry for _, entry in outcomes]


def on_rank0_agreed(action: Callable[[], _T], what: str, group: dist.ProcessGroup | None = None) -> _T:
    """Run `action` on the group's first rank only and share its result with every rank, or its failure."""
    outcome: list = [None, None]
    error: BaseException | None = None
    first = dist.get_global_rank(group, 0) if is_distributed() and group is not None else 0
    if not is_distributed() or dist.get_rank() == first:
        try:
            outcome[0] = action()
        except Exception as exc:  # re-raised below, on every rank
            error, outcome[1] = exc, describe(exc)
    if is_distributed():
        dist.broadcast_object_list(outcome, src=first, group=group)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise FailedElsewhere(f"{what} failed on rank {first}: {outcome[1]}")
    return outcome[0]


def make_dir_everywhere(path: Path, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Make `path` on every rank (storage that is not shared between hosts); fails on all if on one."""
    error = None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        error = exc
    all_ranks_succeeded(error, what, group)


def make_dir_on_rank0_then_everywhere(path: Path, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Rank 0 makes `path` first (shared storage), then every rank (storage that is not)."""
    on_rank0_agreed(lambda: path.mkdir(parents=True, exist_ok=True), what, group)
    make_dir_everywhere(path, what, group)


def describe(error: BaseException) -> str:
    """One line for an error; for DCP's (whose repr lists stack frames), one per failing rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {type(cause).__name__}: {cause}"
                         for rank, (cause, _frames) in sorted(error.failures.items()))
    first_line = (str(error).splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
