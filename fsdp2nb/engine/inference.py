"""What generation and evaluation share: each rank's share of the items, and forward passes on the
whole model, gathered once, or sharded in lockstep where the whole model does not fit.

A sharded FSDP2 model all-gathers every unit for every forward pass and frees it again; a token of
generation then costs as many all-gathers as the model has units. `gathered_units(model)` instead
unshards every unit once and turns resharding after forward off until it exits, so forward passes
run on plain tensors and need no collective: each rank works through its own share at its own
pace. On exit the settings are put back as they were and every unit is resharded, so training goes
on unchanged and the memory is freed.

The items (examples, prompts) go to every GPU rank, and on CPU ranks batch by batch: each batch
to one rank, on its part of the host's cores, at most one rank per core. A batch is never split
over processes: decoding is mostly reading every weight once per token, and each process that
decodes part of a batch reads all of them again, where torch's threads share the one read
(docs/benchmarks.md). Batches beyond the first go to ranks of their own, which then work side by
side; ranks beyond the cores would only take turns on them. The others wait. Where all the
ranks are CPU ranks of one host, the whole model is one copy in the host's shared memory that the
working ranks read (`host_gather`), so however many work, it is in memory once.

Where the gathered model would not fit (its bytes in the dtype it is gathered in, against what the
device, or this rank's part of the host's memory, has free; or against `max_gathered_bytes` /
FSDP2NB_MAX_GATHERED_BYTES), every rank runs sharded. `plan_gathering` decides, the same on every
rank, and `as_planned` acts on it. Sharded, forward passes are collective, so the caller must run as
many on every rank (`GatherPlan.lockstep`).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2nb import host_memory
from fsdp2nb.collectives import all_gathered, get_rank, get_world_size
from fsdp2nb.engine import fsdp_internals
from fsdp2nb.engine.host_gather import can_gather_in_shared_memory, whole_in_shared_memory
from fsdp2nb.errors import UsageMistake
from fsdp2nb.sizes import size

logger = logging.getLogger(__name__)

MAX_GATHERED_BYTES_ENV = "FSDP2NB_MAX_GATHERED_BYTES"
"""Bytes a rank may spend on the gathered model; above it, generation and evaluation run sharded."""

GATHER_HEADROOM = 0.8
"""The share of a rank's free memory the gathered model may take: the rest is left for the KV
cache, activations, logits and the all-gather's staging."""


class InferenceInputError(UsageMistake):
    """Input that `fsdp2nb.generate` or `fsdp2nb.evaluate` cannot use: raised before any rank
    changes anything, with one line saying what was wrong and what to do."""


def rank_share(num_items: int, rank: int, world_size: int) -> range:
    """The items of `rank` when `num_items` are spread over `world_size` ranks in order: contiguous,
    the first `num_items % world_size` ranks one more. 5 items on 2 ranks: range(0, 3), range(3, 5)."""
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True, slots=True)
class GatherPlan:
    """Whether every rank gathers the whole model, and the figures that decided it."""

    gathered: bool
    """True: every FSDP unit is unsharded for the duration, so forward passes need no collective."""
    lockstep: bool
    """True: the model stays sharded over several ranks, so every forward pass is collective and
    every rank must run as many as the others."""
    needed_bytes: int
    """What the gathered parameters take on a rank, in the dtype they are gathered in."""
    available_bytes: tuple[int, ...]
    """Per rank: free device memory, or its part of the host's available memory on CPU ranks."""
    limit_bytes: int | None
    """`max_gathered_bytes` (or FSDP2NB_MAX_GATHERED_BYTES) where one was given."""
    reason: str = ""
    """Why the model stays sharded, with the figures; empty when it is gathered."""
    device_type: str = "cpu"
    """Where the forward passes run ("cpu", "cuda")."""
    working_ranks: tuple[int, ...] = ()
    """The ranks that take items, in rank order (`item_share`): every GPU rank and of each host's
    CPU ranks the first, one per batch and per core (every rank where the model stays sharded:
    forward passes are collective)."""
    working_threads: tuple[int, ...] = ()
    """Per rank, the torch threads it runs with for the duration: for a working CPU rank, the
    host's cores over its working ranks; 0 to keep its own share of the cores."""
    one_host: bool = False
    """True: every rank is a CPU rank of one host, so the whole model can be one copy in its shared
    memory (`host_gather`)."""


def item_share(num_items: int, rank: int, working_ranks: tuple[int, ...]) -> range:
    """The items of `rank` when `num_items` are spread over `working_ranks` in order (`rank_share`);
    empty for a rank that is not among them."""
    if rank not in working_ranks:
        return range(0)
    return rank_share(num_items, working_ranks.index(rank), len(working_ranks))


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The modules `fully_shard` was applied to, outermost first."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def gathered_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take gathered on one rank: whole tensors, in the dtype the
    FSDP2 mixed-precision policy gathers them in (else their own)."""
    param_dtype = _gather_dtype(model)
    total = 0
    for param in model.parameters():
        dtype = param_dtype if param_dtype is not None and param.is_floating_point() else param.dtype
        total += param.numel() * torch.empty((), dtype=dtype).element_size()  # DTensor: the global numel
    return total


def _gather_dtype(model: nn.Module) -> torch.dtype | None:
    # The engine gives every unit the same MixedPrecisionPolicy, so the root's stands for all.
    return fsdp_internals.gather_dtype(model) if isinstance(model, FSDPModule) else None


def available_bytes(device: torch.device) -> int:
    """Memory this rank may use: the GPU's free memory plus what torch's allocator holds unused;
    on CPU ranks the host's available memory (its cgroup's, in a container) divided among the
    ranks of this host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return host_memory.available_bytes() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def model_device(model: nn.Module) -> torch.device:
    """Where forward passes run: the device of the mesh the model is sharded on, else of its parameters."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh_type = param.device_mesh.device_type
            return torch.device(mesh_type, torch.cuda.current_device()) if mesh_type == "cuda" else torch.device(mesh_type)
        return param.device
    return torch.device("cpu")


def max_gathered_bytes_from(value: int | None) -> int | None:
    """The limit a call asked for, else FSDP2NB_MAX_GATHERED_BYTES, else None (no limit)."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InferenceInputError(f"max_gathered_bytes={value!r} must be an int >= 0 (bytes), or None")
        return value
    text = os.environ.get(MAX_GATHERED_BYTES_ENV, "").strip()
    if not text:
        return None
    try:
        return int(float(text))
    except ValueError:
        raise InferenceInputError(
            f"{MAX_GATHERED_BYTES_ENV}={text!r} must be a number of bytes, e.g. 8e9") from None


def plan_gathering(model: nn.Module, limit_bytes: int | None, local_facts: tuple[int, ...] = (), *,
                   num_batches: int | None = None) -> tuple[GatherPlan, list[tuple[int, ...]]]:
    """Decide, the same on every rank, whether the whole model is gathered and which ranks take items:
    every rank, or given `num_batches` (the batches the items make) of each host's CPU ranks one per
    batch and per core, on the host's cores split among them (`working_ranks`).

    Collective: one exchange of a few integers (`collectives.all_gathered`), on the model's device.
    `local_facts` travel with this rank's figures, so that a caller can compare what the ranks were
    given (their prompts) in the same exchange; every rank's facts come back, in rank order. A
    model without FSDP units is whole on every rank already."""
    sharded = bool(fsdp_units(model))
    needed = gathered_bytes(model) if sharded else 0
    device = model_device(model)
    own_facts = [available_bytes(device) if sharded else 0, *_host_cores(device)]
    mine = torch.tensor([*own_facts, *local_facts], dtype=torch.int64, device=device)
    rows = [tuple(row) for row in all_gathered(mine).tolist()]
    available = tuple(row[0] for row in rows)
    reason = _why_sharded(needed, available, limit_bytes) if sharded else ""
    lockstep = bool(reason) and get_world_size() > 1
    host_cores = [row[1:3] for row in rows]
    if lockstep or num_batches is None:
        working, threads = tuple(range(len(rows))), (0,) * len(rows)
    else:
        working = working_ranks(host_cores, num_batches)
        threads = working_threads(host_cores, working)
    one_host = device.type == "cpu" and len({host for host, _cores in host_cores}) == 1
    plan = GatherPlan(gathered=sharded and not reason, lockstep=lockstep, needed_bytes=needed,
                      available_bytes=available, limit_bytes=limit_bytes, reason=reason, device_type=device.type,
                      working_ranks=working, working_threads=threads, one_host=one_host)
    return plan, [row[len(own_facts):] for row in rows]


def _host_cores(device: torch.device) -> tuple[int, int]:
    """(an id of this rank's host, the cores this rank may run on); 0 cores on a GPU rank, whose
    work is the device's."""
    if device.type != "cpu":
        return 0, 0
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    host = int(hashlib.sha256(f"{socket.gethostname()} {boot_id}".encode()).hexdigest()[:15], 16)
    return host, len(os.sched_getaffinity(0))


def working_ranks(host_cores: list[tuple[int, int]], num_batches: int) -> tuple[int, ...]:
    """Every GPU rank (0 cores), and of each host's CPU ranks the first, as many as the host has
    cores and no more than `num_batches`; `host_cores` is (host id, cores) per rank."""
    working, per_host = [], collections.Counter()
    for rank, (host, cores) in enumerate(host_cores):
        if cores == 0 or per_host[host] < min(cores, num_batches):
            working.append(rank)
            per_host[host] += 1
    return tuple(working)


def working_threads(host_cores: list[tuple[int, int]], working: tuple[int, ...]) -> tuple[int, ...]:
    """Per rank, the torch threads of a working CPU rank: its host's cores split evenly over the
    host's working ranks; 0 (its own threads kept) for every other rank."""
    per_host = collections.Counter(host_cores[rank][0] for rank in working)
    return tuple(max(1, cores // per_host[host]) if rank in working and cores else 0
                 for rank, (host, cores) in enumerate(host_cores))


def _why_sharded(needed: int, available: tuple[int, ...], limit_bytes: int | None) -> str:
    if limit_bytes is not None and needed > limit_bytes:
        return (f"the gathered model needs {size(needed)} per rank, over the limit of {size(limit_bytes)} "
                f"(max_gathered_bytes / {MAX_GATHERED_BYTES_ENV})")
    tightest = min(range(len(available)), key=lambda rank: available[rank])
    if needed > GATHER_HEADROOM * available[tightest]:
        return (f"the gathered model needs {size(needed)} per rank, more than {GATHER_HEADROOM:.0%} of the "
                f"{size(available[tightest])} rank {tightest} has free")
    return ""


@contextlib.contextmanager
def as_planned(model: nn.Module, plan: GatherPlan, what: str) -> Iterator[None]:
    """Run the body with every unit of `model` gathered where `plan` says so. Where the model stays
    sharded for want of memory, rank 0 logs why, once, with the figures; on exit every unit is
    resharded then too (a unit set not to reshard after forward, as the engine sets the output
    head, would otherwise keep its gathered weights until the next backward)."""
    if plan.gathered:
        with _whole_where_needed(model, plan), fsdp_forward_hooks_set_aside(model), _host_threads(plan):
            yield
        return
    if plan.reason and get_rank() == 0:
        logger.warning("%s runs sharded, in lockstep: %s", what, plan.reason)
    try:
        yield
    finally:
        for unit in fsdp_units(model):
            unit.reshard()


@contextlib.contextmanager
def _whole_where_needed(model: nn.Module, plan: GatherPlan) -> Iterator[None]:
    """The whole model on the ranks that work: one copy in shared memory that they read, where all
    the ranks are on one host and it has room (`host_gather`), else every unit unsharded on every
    rank."""
    if plan.one_host and can_gather_in_shared_memory(model):
        for unit in fsdp_units(model):
            unit.reshard()  # a unit left unsharded by a forward without backward: sharded again first
        with whole_in_shared_memory(model, plan.working_ranks, _gather_dtype(model)) as shared:
            if shared:
                yield
                return
    with gathered_units(model):
        yield


@contextlib.contextmanager
def _host_threads(plan: GatherPlan) -> Iterator[None]:
    """A working CPU rank runs torch on its part of the host's cores, until exit. (Several ranks
    each on every core would slow all of them: torch's threads spin while they wait.)"""
    threads = torch.get_num_threads()
    if plan.working_threads and plan.working_threads[get_rank()]:
        torch.set_num_threads(plan.working_threads[get_rank()])
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def gathered_units(model: nn.Module) -> Iterator[None]:
    """Unshard every FSDP unit once and keep it so until exit; then settings back and reshard."""
    units = fsdp_units(model)
    saved = [fsdp_internals.reshard_settings(unit) for unit in units]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        pending = [unit.unshard(async_op=True) for unit in units]  # posted together: one wait, not one per unit
        for handle in pending:
            if handle is not None:
                handle.wait()
        yield
    finally:
        for unit, settings in zip(units, saved, strict=True):
            fsdp_internals.restore_reshard_settings(unit, settings)
        for unit in units:
            unit.reshard()


@contextlib.contextmanager
def fsdp_forward_hooks_set_aside(model: nn.Module) -> Iterator[None]:
    """FSDP2's own forward hooks left out of forward passes until exit; for gathered units without
    gradients only, where they have nothing to do: unsharding and resharding are no-ops, and
    nothing prepares a backward. They cost a good part of a small model's decoding step on CPU
    (docs/benchmarks.md) and append to FSDP's post-forward order, which only a backward clears.
    Other hooks stay; on exit each hook table is as it was, in its order. (The first forward with
    the hooks back does FSDP's lazy initialisation, if none did before.)"""
    fsdp_ids: set[int] = set()
    for unit in fsdp_units(model):
        fsdp_ids.update(fsdp_internals.forward_hook_ids(unit))
    with fsdp_internals.forward_hooks_removed(model, fsdp_ids):
        yield


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode and no gradients, until exit; then each module's mode as it was."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training

