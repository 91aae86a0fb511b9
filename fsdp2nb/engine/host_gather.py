"""The whole parameters of a sharded model, one copy for a host, read by the ranks that need them:
what CPU ranks of one host use to generate and evaluate.

CPU ranks of one host share its memory, so nothing need be sent and nothing held twice. The first
reader makes one file in shared memory as large as the whole model (in /dev/shm or
FSDP2NB_SHARED_MEMORY_DIR, in a directory only this user may enter); every rank maps it and copies
its own rows of every parameter to where they belong; the readers use the parameters in place, as
views of the file. The file is unlinked as soon as every rank has mapped it, and its memory goes
when the last reader lets go of the views on exit. The other ranks unmap it once their rows are
in, and hold no more memory than before. (Which ranks read is the caller's choice:
`inference.working_ranks`.)

Where a rank cannot map the file (no room in shared memory, another host), every rank says so and
`whole_in_shared_memory` yields False having changed nothing; the caller then unshards the model
on every rank instead.

Only for a 1-D mesh whose parameters are all `Shard(0)`, as `fully_shard` makes them; the readers'
forward passes must run with FSDP2's hooks set aside (`inference.fsdp_forward_hooks_set_aside`),
which would otherwise unshard, a collective the other ranks never join.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdp2nb.collectives import all_gathered
from fsdp2nb.engine.model_census import rows_per_rank
from fsdp2nb.host.memory_store import SHARED_MEMORY_DIR_ENV as SHARED_MEMORY_DIR_ENV  # the one tmpfs setting
from fsdp2nb.host.memory_store import shared_memory_dir

logger = logging.getLogger(__name__)

ALIGNMENT = 64
"""Each parameter starts on a cache line of the file."""

MAX_PATH_BYTES = 512
"""The file's path travels from the root to the other ranks in a tensor of this many bytes."""


def can_gather_in_shared_memory(model: nn.Module) -> bool:
    """True where every parameter is a DTensor sharded along dim 0 of one 1-D mesh."""
    params = list(model.parameters())
    return bool(params) and all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.placements == (Shard(0),)
                                for p in params)


@contextlib.contextmanager
def whole_in_shared_memory(model: nn.Module, readers: tuple[int, ...], dtype: torch.dtype | None) -> Iterator[bool]:
    """On each rank of `readers`, every parameter whole (in `dtype` where given, for floating point
    ones) until exit, all of them views of one file; collective. Yields True, or on every rank
    False where some rank could not map the shared file (then nothing changed). The model must be
    resharded on entry."""
    params = _unique_params(model)
    group = params[0].device_mesh.get_group()
    layout = FileLayout.of(params, dist.get_world_size(group), dtype)
    shared = _every_rank_rows_in_shared_file(layout, params, readers[0], group)
    if shared is None:
        yield False
        return
    if dist.get_rank() not in readers:
        del shared  # unmapped: only the readers need the file
        yield True
        return
    swapped = _swap(model, layout.whole_views(params, shared))
    try:
        yield True
    finally:
        for module, name, param in swapped:
            setattr(module, name, param)


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Where each parameter lies in the shared file: whole tensors one after the other, each
    made of every rank's rows in rank order (the order `torch.chunk` and FSDP2 shard them in)."""

    offsets: tuple[int, ...]
    """Byte offset of each parameter, a multiple of ALIGNMENT."""
    dtypes: tuple[torch.dtype, ...]
    """Each parameter's dtype in the file: the gathered dtype for floating point ones."""
    rows: tuple[tuple[int, ...], ...]
    """Per parameter, rows of dim 0 on each rank."""
    num_bytes: int

    @classmethod
    def of(cls, params: list[DTensor], world_size: int, dtype: torch.dtype | None) -> FileLayout:
        offsets, dtypes, rows, end = [], [], [], 0
        for param in params:
            file_dtype = dtype if dtype is not None and param.is_floating_point() else param.dtype
            start = -(-end // ALIGNMENT) * ALIGNMENT
            offsets.append(start)
            dtypes.append(file_dtype)
            rows.append(rows_per_rank(param.shape[0], world_size))
            end = start + param.numel() * file_dtype.itemsize  # DTensor: the global numel
        return cls(tuple(offsets), tuple(dtypes), tuple(rows), max(end, 1))

    def _whole(self, index: int, param: DTensor, shared: torch.Tensor) -> torch.Tensor:
        """The parameter's whole tensor in the file, flat (a view)."""
        num_bytes = param.numel() * self.dtypes[index].itemsize
        return shared[self.offsets[index]:self.offsets[index] + num_bytes].view(self.dtypes[index])

    def rows_match(self, params: list[DTensor], rank: int) -> bool:
        """Whether `rank` holds the rows this layout expects of it (FSDP2 shards as torch.chunk)."""
        return all(param.to_local().shape[0] == self.rows[index][rank] for index, param in enumerate(params))

    def write_own_rows(self, params: list[DTensor], rank: int, shared: torch.Tensor) -> None:
        """Copy `rank`'s rows of every parameter into their place, cast to the file's dtype."""
        for index, param in enumerate(params):
            row_numel = math.prod(param.shape[1:])
            start = sum(self.rows[index][:rank]) * row_numel
            local = param.to_local().reshape(-1)
            self._whole(index, param, shared)[start:start + local.numel()].copy_(local)

    def whole_views(self, params: list[DTensor], shared: torch.Tensor) -> dict[int, nn.Parameter]:
        """Each parameter whole, a view of the file; keyed by the sharded parameter's id."""
        return {id(param): nn.Parameter(self._whole(index, param, shared).view(param.shape), requires_grad=False)
                for index, param in enumerate(params)}


def _every_rank_rows_in_shared_file(layout: FileLayout, params: list[DTensor], root: int,
                                    group: dist.ProcessGroup) -> torch.Tensor | None:
    """The shared file mapped (uint8) with every rank's rows in it, on every rank; or None on every
    rank where some rank could not map it or place its rows. Collective: a broadcast of the path,
    then a vote once each rank has written (which is also the wait for the others' rows). The file
    is unlinked after the vote, so it never outlives the call, whatever happens next."""
    directory = _make_file(layout.num_bytes) if dist.get_rank() == root else None
    try:
        path = _broadcast_path(os.path.join(directory, "weights") if directory else "", root, group)
        me = dist.get_rank(group)
        shared = _map(path, layout.num_bytes) if layout.rows_match(params, me) else None
        if shared is not None:
            layout.write_own_rows(params, me, shared)
        every_vote = all_gathered(torch.tensor([int(shared is not None)]), group)
    finally:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
    return shared if bool(every_vote.all()) else None


def _make_file(num_bytes: int) -> str | None:
    """A private directory in shared memory holding a file of `num_bytes`, its space reserved (a
    write beyond a full tmpfs would kill the process); None where that is not possible."""
    directory = None
    try:
        directory = tempfile.mkdtemp(prefix="fsdp2nb-gather-", dir=shared_memory_dir())  # 0700
        descriptor = os.open(os.path.join(directory, "weights"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, num_bytes)
        finally:
            os.close(descriptor)
        return directory
    except OSError as exc:
        logger.info("the whole model is gathered on every rank: no room for it in %s (%s)", shared_memory_dir(), exc)
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        return None


def _broadcast_path(path: str, root: int, group: dist.ProcessGroup) -> str:
    """The root's `path` on every rank ("" where the root has none), as bytes in a tensor."""
    encoded = path.encode()
    if len(encoded) > MAX_PATH_BYTES:
        encoded = b""  # an unusual temp dir: the vote fails and the caller falls back
    buffer = torch.zeros(MAX_PATH_BYTES, dtype=torch.uint8)
    buffer[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=root, group=group)
    return bytes(buffer.tolist()).rstrip(b"\0").decode()


def _map(path: str, num_bytes: int) -> torch.Tensor | None:
    if not path:
        return None
    try:
        return torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    except (OSError, RuntimeError) as exc:  # torch reports a failed open or mmap as RuntimeError
        logger.info("cannot map %s, the whole model is gathered on every rank: %s", path, exc)
        return None


def _unique_params(model: nn.Module) -> list[DTensor]:
    """Each parameter once (tied ones share one), in the model's order."""
    seen: dict[int, DTensor] = {}
    for param in model.parameters():
        seen.setdefault(id(param), param)
    return list(seen.values())


def _swap(model: nn.Module, whole: dict[int, nn.Parameter]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """The whole tensors in place of the sharded parameters; what was there, to put back."""
    swapped = []
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) in whole:
                swapped.append((module, name, param))
                setattr(module, name, whole[id(param)])
    return swapped
