"""The snapshot's small state round-trips, and a stream that names a class is refused unread."""

from __future__ import annotations

import pickle

import pytest
import torch

from fsdp2nb.checkpoint import plain_pickle
from fsdp2nb.checkpoint.rng import capture_rng_state


def test_rng_streams_and_hyperparameters_round_trip_exactly():
    state = {"rng": capture_rng_state(), "groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "fused": None}],
             "step": 7, "weights": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    loaded = plain_pickle.loads(plain_pickle.dumps(state))
    assert loaded["rng"]["python"] == state["rng"]["python"]
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    assert loaded["groups"] == state["groups"] and loaded["step"] == 7
    assert loaded["weights"].dtype == torch.bfloat16 and torch.equal(loaded["weights"], state["weights"])


class _Sneaky:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_stream_naming_any_class_is_refused():
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        plain_pickle.loads(pickle.dumps({"x": _Sneaky()}))
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        plain_pickle.loads(pickle.dumps(torch.ones(2)))  # torch's own reduction names its rebuild function
