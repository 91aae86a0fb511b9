"""RNG streams across a change of world size: rank r gets back rank r's stream where both exist."""

from __future__ import annotations

import logging
import random

import torch
import torch.distributed as dist

from fsdp2nb.checkpoint import Checkpointer
from tests.support.checkpoint_helpers import build
from tests.support.gloo_harness import run_ranks

STEP = 4


def _draws() -> tuple[float, list[float]]:
    return random.random(), torch.rand(3).tolist()


def _save_and_draw(directory: str) -> tuple:
    """Save with a stream of its own on each rank; return what that stream draws next."""
    rank = dist.get_rank()
    model, optimizer, _ = build()
    random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    with Checkpointer(directory, async_save=False) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).save(STEP)
    return _draws()


def _load_and_draw(directory: str) -> dict:
    rank = dist.get_rank()
    model, optimizer, _ = build()
    random.seed(500 + rank)
    torch.manual_seed(500 + rank)
    untouched = _draws()
    random.seed(500 + rank)
    torch.manual_seed(500 + rank)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("fsdp2nb.checkpoint").addHandler(handler)
    with Checkpointer(directory) as ckpt:
        ckpt.track(model=model, optimizer=optimizer).load(STEP)
    return {"draws": _draws(), "untouched": untouched, "log": [r for r in records if "RNG" in r]}


def test_rng_streams_map_by_rank_when_the_world_grows(tmp_path):
    (saved,) = run_ranks(_save_and_draw, 1, str(tmp_path))
    rank0, rank1 = run_ranks(_load_and_draw, 2, str(tmp_path))
    assert rank0["draws"] == saved  # rank 0 carries on with the saved stream
    assert rank1["draws"] == rank1["untouched"]  # rank 1 had no stream saved: left as it was
    assert rank0["log"] == [f"checkpoint step {STEP}: saved on 1 ranks, loaded on 2: the RNG of rank 1 was not "
                            "restored (no saved stream); ranks below keep their saved streams"]
    assert rank1["log"] == []


def test_rng_streams_map_by_rank_when_the_world_shrinks(tmp_path):
    saved = run_ranks(_save_and_draw, 2, str(tmp_path))
    (rank0,) = run_ranks(_load_and_draw, 1, str(tmp_path))
    assert rank0["draws"] == saved[0] != saved[1]
    assert rank0["log"] == [f"checkpoint step {STEP}: saved on 2 ranks, loaded on 1: the saved RNG streams of "
                            "rank 1 were not restored (no such rank now); ranks below keep their saved streams"]
