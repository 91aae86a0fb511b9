"""Capture and restore a rank's random number generators, in a form torch.load(weights_only) accepts."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy (if installed), torch CPU and CUDA (if initialised) generator states."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned; a generator absent from `state` is left alone."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        _set_numpy_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_streams_not_restored(saved_world_size: int, world_size: int) -> str | None:
    """One line saying which generator streams a load on `world_size` ranks cannot restore from a
    save on `saved_world_size` (rank r restores rank r's stream), or None when every one maps."""
    if saved_world_size == world_size:
        return None
    low, high = sorted((saved_world_size, world_size))
    ranks = f"rank {low}" if high - low == 1 else f"ranks {low}-{high - 1}"
    if world_size > saved_world_size:
        return (f"saved on {saved_world_size} ranks, loaded on {world_size}: the RNG of {ranks} was not "
                "restored (no saved stream); ranks below keep their saved streams")
    return (f"saved on {saved_world_size} ranks, loaded on {world_size}: the saved RNG streams of {ranks} "
            "were not restored (no such rank now); ranks below keep their saved streams")


def _numpy_state() -> dict[str, Any] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    # The key array is uint32; int64 holds it exactly and is a dtype weights_only loading accepts.
    return {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _set_numpy_state(state: dict[str, Any]) -> None:
    import numpy as np

    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["kind"], keys, state["pos"], state["has_gauss"], state["cached"]))
