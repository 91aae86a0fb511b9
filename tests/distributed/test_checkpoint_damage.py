"""Damaged checkpoints and a save failing on one rank: every rank ends in the same, whole state."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from fsdp2nb.checkpoint import Checkpointer, CheckpointSaveError
from fsdp2nb.checkpoint.faults import FAULT_ENV
from fsdp2nb.checkpoint.layout import read_latest, step_dir_name
from tests.support.checkpoint_helpers import build, full_model_state, full_optim_state, train_step
from tests.support.gloo_harness import run_ranks


def _full_state(model, optimizer) -> dict:
    return {**full_model_state(model), **full_optim_state(model, optimizer)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def _damage_rank1_shard(directory: str, how: str) -> str:
    """Rank 0 damages the shard file rank 1 wrote for step 2; every rank gets its name."""
    name = [None]
    if dist.get_rank() == 0:
        (shard,) = Path(directory, step_dir_name(2)).glob("__1_*.distcp")
        name = [shard.name]
        if how == "emptied":
            os.truncate(shard, 0)
        else:  # 256 bytes in the middle: the size stays
            with open(shard, "r+b") as f:
                f.seek(shard.stat().st_size // 2)
                f.write(bytes(range(256)))
    dist.broadcast_object_list(name, src=0)
    return name[0]


def _load_a_damaged_step(directory: str, how: str) -> dict:
    model, optimizer, scheduler = build()
    ckpt = Checkpointer(directory, async_save=False).track(model=model, optimizer=optimizer, scheduler=scheduler)
    train_step(model, optimizer, scheduler)
    ckpt.save(1)
    at_step1 = _full_state(model, optimizer)
    train_step(model, optimizer, scheduler)
    ckpt.save(2)
    train_step(model, optimizer, scheduler)
    shard = _damage_rank1_shard(directory, how)
    before = _full_state(model, optimizer)
    try:
        ckpt.load(2)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    unchanged = _same(before, _full_state(model, optimizer))
    listed = [(e.step, e.valid) for e in ckpt.list()]
    loaded = ckpt.load("latest")
    at_step1_now = _same(at_step1, _full_state(model, optimizer))
    ckpt.close()
    return dict(shard=shard, refusal=refusal, unchanged=unchanged, listed=listed, loaded=loaded,
                at_step1_now=at_step1_now)


@pytest.mark.parametrize("how", ["emptied", "overwritten"])
def test_a_damaged_shard_of_one_rank_is_refused_on_every_rank(tmp_path, how):
    for result in run_ranks(_load_a_damaged_step, 2, str(tmp_path), how):
        assert result["refusal"] is not None and "step" in result["refusal"] and "2" in result["refusal"]
        assert result["shard"] in result["refusal"]
        assert result["unchanged"]  # on every rank: nothing of step 2 reached the live state
        assert result["listed"] == [(1, True), (2, False)]  # once refused, listed as damaged
        assert result["loaded"] == 1 and result["at_step1_now"]


def _save_with_staging_failing_on_rank1(directory: str, async_writer: str) -> dict:
    model, optimizer, scheduler = build()
    ckpt = Checkpointer(directory, async_save=True, async_writer=async_writer).track(
        model=model, optimizer=optimizer, scheduler=scheduler)
    train_step(model, optimizer, scheduler)
    ckpt.save(1)
    ckpt.wait()
    train_step(model, optimizer, scheduler)
    os.environ[FAULT_ENV] = "stage_copy@1"
    try:
        ckpt.save(2)
        train_step(model, optimizer, scheduler)  # the optimizer step waits for the (failed) copy
        ckpt.wait()
        failure = None
    except CheckpointSaveError as error:
        failure = str(error)
    finally:
        del os.environ[FAULT_ENV]
    latest_after_failure = read_latest(Path(directory))
    train_step(model, optimizer, scheduler)  # training goes on, and so do saves
    ckpt.save(3)
    ckpt.wait()
    ckpt.close()
    return dict(failure=failure, latest_after_failure=latest_after_failure, latest=read_latest(Path(directory)))


@pytest.mark.parametrize("async_writer", ["thread", "process"])
def test_staging_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path, async_writer):
    for result in run_ranks(_save_with_staging_failing_on_rank1, 2, str(tmp_path), async_writer):
        assert result["failure"] is not None and "save of step 2 failed" in result["failure"]
        assert "rank 1: copying the state failed: MemoryError" in result["failure"]
        assert result["latest_after_failure"] == 1
        assert result["latest"] == 3
