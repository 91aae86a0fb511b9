"""A rank SIGKILLed at points inside a save: the previous LATEST still loads, unchanged.

Ranks are started with the harness's start_ranks (run_ranks treats a dead rank as a failure); the
victim kills itself through the FSDP2NB_CKPT_FAULT hook, the survivors are then killed too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.checkpoint.faults import FAULT_ENV
from tests.support.checkpoint_helpers import assert_same, build, full_model_state, train_step
from tests.support.gloo_harness import start_ranks

WORLD_SIZE = 2
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def fault_worker(directory: str, fault: str) -> None:
    """Save step 1, record its full state, train on, then die inside the save of step 2."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    store = dist.FileStore(os.path.join(directory, "..", "store"), WORLD_SIZE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(rank)
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, async_save=True).track(model=model, optimizer=optimizer, scheduler=scheduler)
    train_step(model, optimizer, scheduler)
    ckpt.save(1)
    ckpt.wait()
    reference = full_model_state(model)
    if rank == 0:
        torch.save(reference, os.path.join(directory, "..", "reference.pt"))
    train_step(model, optimizer, scheduler)
    os.environ[FAULT_ENV] = fault
    ckpt.save(2)
    ckpt.wait()
    raise AssertionError(f"rank {rank} survived a save that should have been killed at {fault}")


def _run_until_victim_dies(directory: Path, fault: str, victim: int) -> None:
    ranks = start_ranks(fault_worker, WORLD_SIZE, str(directory), fault)
    try:
        ranks[victim].join(timeout=180)
        assert ranks[victim].exitcode == -signal.SIGKILL, f"rank {victim} ended with {ranks[victim].exitcode}"
        time.sleep(1.0)  # survivors are stuck in (or failing) a collective with the dead rank
    finally:
        for rank in ranks:
            rank.kill()
            rank.join()


@pytest.mark.parametrize("fault", ["write_shards@1", "before_metadata@0", "before_latest@0"])
def test_previous_latest_survives_a_rank_killed_mid_save(tmp_path, fault):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    _run_until_victim_dies(directory, fault, victim=int(fault.split("@")[1]))
    assert (directory / "LATEST").read_text().strip() == "step-000001"

    torch.manual_seed(0)
    model, optimizer, scheduler = build(seed=5)  # one process: the 2-rank checkpoint reshards onto 1
    with Checkpointer(directory) as ckpt:
        assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]  # swept on creation
        assert ckpt.latest() == 1
        assert ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler).load("latest") == 1
        steps = {e.step: e.valid for e in ckpt.list()}
    assert_same(full_model_state(model), torch.load(tmp_path / "reference.pt", weights_only=True))
    # Killed after the rename, step 2 is complete on disk but LATEST was never moved to it.
    assert steps == ({1: True, 2: True} if fault == "before_latest@0" else {1: True})
