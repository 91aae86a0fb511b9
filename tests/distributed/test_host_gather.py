"""`host_gather.whole_in_shared_memory`: the whole parameters on the ranks that read them, every
rank's shards copied into one file in shared memory; the other ranks unchanged, every rank as
before on exit, no file left; and where the file cannot be made, nothing changed on any rank."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp2nb.engine.host_gather import (
    SHARED_MEMORY_DIR_ENV,
    can_gather_in_shared_memory,
    whole_in_shared_memory,
)
from fsdp2nb.engine.inference import as_planned, fsdp_forward_hooks_set_aside, plan_gathering
from tests.support.gloo_harness import run_ranks


class TiedModel(nn.Module):
    """Uneven shards (5 and 3 rows on 3 ranks), an empty one, and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.hidden = nn.Linear(4, 3)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        return self.out(hidden + self.hidden(hidden).sum(-1, keepdim=True))


def _sharded_tied_models() -> tuple[TiedModel, TiedModel]:
    """The same weights whole and sharded over every rank."""
    torch.manual_seed(0)
    plain = TiedModel()
    model = TiedModel()
    model.load_state_dict(plain.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.hidden, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return plain, model


def _gather_on_ranks(readers: tuple[int, ...], dtype: torch.dtype | None, shared_dir: str):
    os.environ[SHARED_MEMORY_DIR_ENV] = shared_dir
    plain, model = _sharded_tied_models()
    before = [(name, param.to_local().clone()) for name, param in model.named_parameters()]
    ids = torch.tensor([[0, 3, 4]])
    with torch.no_grad(), whole_in_shared_memory(model, readers, dtype) as shared, fsdp_forward_hooks_set_aside(model):
        dist.barrier()  # the readers are in here too
        files_left = os.listdir(shared_dir)  # unlinked once every rank mapped it
        mapped_inside = _maps_the_file(shared_dir)  # the readers only
        kinds = {type(param).__name__ for param in model.parameters()}
        tied = model.out.weight is model.embed.weight
        if dist.get_rank() in readers:
            same_values = all(torch.equal(mine, plain.get_parameter(name).to(mine.dtype))
                              for name, mine in model.named_parameters())
            dtypes = {str(param.dtype) for param in model.parameters()}
            reference = copy.deepcopy(plain).to(dtype) if dtype is not None else plain
            output_matches = torch.allclose(model(ids), reference(ids), atol=1e-6)
        else:
            same_values, dtypes, output_matches = None, None, None
    mapped_after = _maps_the_file(shared_dir)
    after = [(name, param.to_local()) for name, param in model.named_parameters()]
    restored = [type(param).__name__ for param in model.parameters()] == ["DTensor"] * len(before) and all(
        a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(before, after, strict=True))
    mapped_where_wanted = mapped_inside == (dist.get_rank() in readers) and not mapped_after
    return (shared and files_left == [] and mapped_where_wanted, can_gather_in_shared_memory(model), sorted(kinds), tied, same_values, dtypes,
            output_matches, restored, model.out.weight is model.embed.weight)


def _maps_the_file(shared_dir: str) -> bool:
    """Whether this process has the gathered file mapped (unlinked, it stays in /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return any(shared_dir in line for line in maps)


@pytest.fixture
def shared_dir():
    """A directory of this test's own in shared memory, to see what is left in it."""
    path = tempfile.mkdtemp(prefix="fsdp2nb-test-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize(("readers", "dtype"), [((0,), None), ((2,), torch.bfloat16), ((0, 1, 2), None)])
def test_the_readers_hold_the_whole_model_and_every_rank_gets_its_shards_back(readers, dtype, shared_dir):
    results = run_ranks(_gather_on_ranks, 3, readers, dtype, shared_dir)
    wanted_dtype = {str(dtype or torch.float32)}
    for rank, result in enumerate(results):
        gathered_no_file_left, gatherable, kinds, tied, same_values, dtypes, output_matches, restored, tied_after = result
        assert gathered_no_file_left and gatherable and tied and restored and tied_after, (rank, result)
        if rank in readers:
            assert kinds == ["Parameter"] and same_values and dtypes == wanted_dtype and output_matches, result
        else:
            assert kinds == ["DTensor"] and same_values is None, result  # the others hold no more than before


def _gather_without_shared_memory(missing_dir: str):
    os.environ[SHARED_MEMORY_DIR_ENV] = missing_dir
    _plain, model = _sharded_tied_models()
    with torch.no_grad(), whole_in_shared_memory(model, (0,), None) as shared:
        kinds = sorted({type(param).__name__ for param in model.parameters()})
    return shared, kinds


def test_where_the_root_cannot_make_the_file_no_rank_changes_anything(tmp_path):
    results = run_ranks(_gather_without_shared_memory, 2, str(tmp_path / "missing"))
    assert results == [(False, ["DTensor"])] * 2


def _threads_while_planned(num_batches: int | None, shared_dir: str):
    os.environ[SHARED_MEMORY_DIR_ENV] = shared_dir
    torch.set_num_threads(1)
    _plain, model = _sharded_tied_models()
    with torch.no_grad():
        plan, _ = plan_gathering(model, None, num_batches=num_batches)
        with as_planned(model, plan, "a test"):
            threads = torch.get_num_threads()
            whole = type(model.out.weight).__name__
            output = model(torch.tensor([[0, 3, 4]])).shape if dist.get_rank() in plan.working_ranks else None
            mapped = _maps_the_file(shared_dir)
    return plan.working_ranks, threads, whole, output, torch.get_num_threads(), mapped


def test_a_rank_decoding_alone_takes_the_host_s_cores_and_ranks_decoding_together_split_them(shared_dir):
    """Decoding one batch: one rank, on every core, the whole model on it alone; two batches: a
    rank per core, the cores split between them; without batches: every rank, on its own threads. The
    ranks that work read the one copy in shared memory."""
    cores = len(os.sched_getaffinity(0))
    one_output = torch.Size([1, 3, 5])
    alone = run_ranks(_threads_while_planned, 2, 1, shared_dir)
    assert alone == [((0,), cores, "Parameter", one_output, 1, True), ((0,), 1, "DTensor", None, 1, False)]
    if cores >= 2:
        split = run_ranks(_threads_while_planned, 2, 2, shared_dir)
        assert split == [((0, 1), cores // 2, "Parameter", one_output, 1, True)] * 2
    together = run_ranks(_threads_while_planned, 2, None, shared_dir)
    assert together == [((0, 1), 1, "Parameter", one_output, 1, True)] * 2


def test_without_shared_memory_every_rank_unshards_and_the_working_rank_runs(tmp_path):
    cores = len(os.sched_getaffinity(0))
    results = run_ranks(_threads_while_planned, 2, 1, str(tmp_path / "missing"))
    assert results == [((0,), cores, "Parameter", torch.Size([1, 3, 5]), 1, False), ((0,), 1, "Parameter", None, 1, False)]
