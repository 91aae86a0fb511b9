"""What a rank knows it trains without a Checkpointer: the model `load_model` returned last and
the optimizers that stepped over it, both held weakly."""

from __future__ import annotations

import gc

import torch

from fsdp2nb.engine.loaded_model import last_loaded_model, note_loaded, optimizers_of


def _step(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def test_the_optimizers_that_stepped_over_the_loaded_model_are_found_and_no_others():
    model, other = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    note_loaded(model)
    stepped, idle, elsewhere = (torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters()),
                                torch.optim.AdamW(other.parameters()))
    _step(stepped, model)
    _step(elsewhere, other)
    assert last_loaded_model() is model
    assert optimizers_of(model) == [stepped]  # `idle` never stepped: it holds no state
    assert idle.state == {}


def test_a_model_or_optimizer_the_notebook_drops_is_not_kept_alive():
    model = torch.nn.Linear(4, 4)
    note_loaded(model)
    _step(torch.optim.AdamW(model.parameters()), model)
    gc.collect()
    assert optimizers_of(model) == []
    del model
    gc.collect()
    assert last_loaded_model() is None
