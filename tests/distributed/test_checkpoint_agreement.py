"""Ranks that disagree or fail alone get the same error on every rank, never a hang in a collective."""

from __future__ import annotations

import torch.distributed as dist

from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.checkpoint.layout import rank_file_name, read_latest, step_dir_name
from tests.support.checkpoint_helpers import build, full_model_state, train_step
from tests.support.gloo_harness import run_ranks


def _save_different_steps(directory: str) -> dict:
    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler)
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler).save(1)
        try:
            ckpt.save(5 + dist.get_rank())  # rank 0 asks for step 5, rank 1 for step 6
        except ValueError as error:
            message = str(error)
        return {"message": message, "steps": [e.step for e in ckpt.list()], "latest": ckpt.latest()}


def test_ranks_saving_different_steps_fail_alike_and_commit_nothing(tmp_path):
    for result in run_ranks(_save_different_steps, 2, str(tmp_path)):
        assert "different steps (5 to 6)" in result["message"]
        assert result["steps"] == [1] and result["latest"] == 1
    assert read_latest(tmp_path) == 1


def _load_with_a_damaged_rank_file(directory: str) -> dict:
    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler)
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer, scheduler=scheduler).save(3)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(f"{directory}/{step_dir_name(3)}/{rank_file_name(1)}", "r+b") as damaged:
                damaged.write(b"not a checkpoint")
        dist.barrier()
        train_step(model, optimizer, scheduler)
        before = full_model_state(model)
        try:
            ckpt.load(3)
        except ValueError as error:
            message = str(error)
        after = full_model_state(model)
    return {"message": message, "unchanged": all(before[k].equal(after[k]) for k in before)}


def test_a_damaged_rank_file_fails_the_load_on_every_rank_and_changes_nothing(tmp_path):
    results = run_ranks(_load_with_a_damaged_rank_file, 2, str(tmp_path))
    assert all("checkpoint step 3 is damaged" in r["message"] and r["unchanged"] for r in results)
    assert all(rank_file_name(1) in r["message"] for r in results)  # every rank names the file
    assert results[0]["message"] == results[1]["message"]


def _agree_on_failures() -> dict:
    from fsdp2nb.collectives import all_ranks_succeeded, on_rank0_agreed

    seen = {"shared": on_rank0_agreed(lambda: "rank 0's answer", "asking rank 0")}

    def fails_on_rank0():
        raise OSError("no space left on device")

    for name, call in (("rank0", lambda: on_rank0_agreed(fails_on_rank0, "creating the directory")),
                       ("rank1", lambda: all_ranks_succeeded(
                           OSError("read-only file system") if dist.get_rank() == 1 else None, "writing shards"))):
        try:
            call()
        except Exception as error:  # what each rank raised is the result
            seen[name] = f"{type(error).__name__}: {error}"
    return seen


def test_a_step_failing_on_one_rank_raises_on_every_rank_naming_it():
    rank0, rank1 = run_ranks(_agree_on_failures, 2)
    assert rank0["shared"] == rank1["shared"] == "rank 0's answer"
    assert rank0["rank0"] == "OSError: no space left on device"
    assert rank1["rank0"] == "FailedElsewhere: creating the directory failed on rank 0: OSError: no space left on device"
    assert rank0["rank1"] == "FailedElsewhere: writing shards failed on rank 1: OSError: read-only file system"
    assert rank1["rank1"] == "OSError: read-only file system"
