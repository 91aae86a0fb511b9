"""Resume equality, save requests agreed across ranks, and resharding 4 -> 2 -> 1."""

from __future__ import annotations

import random

import pytest
import torch

from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.checkpoint.requests import post_save_request, process_requests
from fsdp2nb.checkpoint.tracking import tracked_checkpointer
from tests.support.checkpoint_helpers import (
    assert_same,
    build,
    full_model_state,
    full_optim_state,
    train_step,
)
from tests.support.gloo_harness import run_ranks

NUM_STEPS = 6
SAVE_AT = 2


def _train_save_resume(directory: str, async_writer: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)
    random.seed(rank)
    model, optimizer, scheduler = build(seed=0)
    ckpt = Checkpointer(directory, keep=2, async_save=True, async_writer=async_writer).track(
        model=model, optimizer=optimizer, scheduler=scheduler)
    saved_at, losses = [], []
    for step in range(NUM_STEPS):
        losses.append(train_step(model, optimizer, scheduler))
        if step == SAVE_AT and rank == 0:
            post_save_request()  # only rank 0 hears the notebook; maybe_save must still agree
        if step == SAVE_AT + 1 and rank == 1:
            post_save_request(1)  # the same request arriving late on rank 1: already served
        if ckpt.maybe_save(step):
            saved_at.append(step)
    ckpt.wait()
    lr_uninterrupted = scheduler.get_last_lr()
    ckpt.close()

    torch.manual_seed(999)  # the resumed run must not depend on the generator's state at load time
    model, optimizer, scheduler = build(seed=7)
    ckpt = Checkpointer(directory, keep=2).track(model=model, optimizer=optimizer, scheduler=scheduler)
    assert tracked_checkpointer() is ckpt
    loaded = ckpt.load("latest")
    resumed = [train_step(model, optimizer, scheduler) for _ in range(loaded + 1, NUM_STEPS)]
    ckpt.close()
    return dict(saved_at=saved_at, losses=losses, loaded=loaded, resumed=resumed,
                lr=(lr_uninterrupted, scheduler.get_last_lr()), served=process_requests().served())


@pytest.fixture(scope="module", params=["thread", "process"])
def resume_results(tmp_path_factory, request) -> list[dict]:
    """Both async writers: a thread of the rank, and DCP's writer process (at low priority)."""
    return run_ranks(_train_save_resume, 2, str(tmp_path_factory.mktemp("ckpt")), request.param)


def test_request_on_one_rank_saves_on_all_ranks_once(resume_results):
    assert [r["saved_at"] for r in resume_results] == [[SAVE_AT], [SAVE_AT]]
    assert [r["served"] for r in resume_results] == [1, 1]


def test_resumed_losses_equal_uninterrupted_exactly(resume_results):
    for r in resume_results:
        assert r["loaded"] == SAVE_AT
        assert r["resumed"] == r["losses"][SAVE_AT + 1:]
        assert r["lr"][0] == r["lr"][1]


def _save_reference(directory: str) -> dict:
    model, optimizer, scheduler = build(seed=3)
    for _ in range(2):
        train_step(model, optimizer, scheduler)
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler).save(5)
    return {"model": full_model_state(model), "optim": full_optim_state(model, optimizer)}


def _load_full(directory: str) -> dict:
    model, optimizer, scheduler = build(seed=11)
    with Checkpointer(directory) as ckpt:
        step = ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler).load(5)
    return {"step": step, "model": full_model_state(model), "optim": full_optim_state(model, optimizer),
            "lr": scheduler.get_last_lr()}


def test_saved_on_4_loads_on_2_and_1_identically(tmp_path):
    reference = run_ranks(_save_reference, 4, str(tmp_path))[0]
    for world_size in (2, 1):
        for loaded in run_ranks(_load_full, world_size, str(tmp_path)):
            assert loaded["step"] == 5
            assert_same(loaded["model"], reference["model"])
            assert_same(loaded["optim"], reference["optim"])


def _save_before_the_first_step(directory: str, async_save: bool) -> dict:
    """Losses of 3 steps after a save at step 0 taken before any optimizer step, of the same 3
    steps without the save, and of 3 steps after loading that save into a trained model."""
    torch.manual_seed(5)
    model, optimizer, scheduler = build(seed=0)
    with Checkpointer(directory, async_save=async_save) as ckpt:
        ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler).save(0)
        ckpt.wait()
        state_after_save = dict(optimizer.state)
        after_save = [train_step(model, optimizer, scheduler) for _ in range(3)]
    torch.manual_seed(5)
    model, optimizer, scheduler = build(seed=0)
    unsaved = [train_step(model, optimizer, scheduler) for _ in range(3)]
    with Checkpointer(directory) as ckpt:
        ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler)
        loaded = ckpt.load(0)
        state_after_load = dict(optimizer.state)
        after_load = [train_step(model, optimizer, scheduler) for _ in range(3)]
    return dict(state_after_save=len(state_after_save), after_save=after_save, unsaved=unsaved,
                loaded=loaded, state_after_load=len(state_after_load), after_load=after_load)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_before_the_first_step_changes_nothing_and_loads_back_unstepped(tmp_path, async_save):
    """DCP's optimizer state dict creates state by a zero-lr step, which sets Adam's step count."""
    for r in run_ranks(_save_before_the_first_step, 2, str(tmp_path), async_save):
        assert r["state_after_save"] == 0, "the save gave the optimizer state"
        assert r["after_save"] == r["unsaved"]
        assert r["loaded"] == 0
        assert r["state_after_load"] == 0, "the load gave the optimizer state it did not have"
        assert r["after_load"] == r["unsaved"]
