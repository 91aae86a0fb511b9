"""Shared pieces of the checkpoint tests: a sharded tiny model, a training step, full-state gathering.

Models are sharded directly with fully_shard (each decoder layer, then the root) so these tests do
not depend on the engine package.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from fsdp2nb.examples.tiny_models import make_tiny_model

SEQ_LEN = 8
BATCH = 2


def shard(model: nn.Module) -> nn.Module:
    """fully_shard each decoder layer, then the root (a no-op wrapper when not distributed)."""
    if not dist.is_initialized():
        return model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def make_lora(model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def build(seed: int = 0, *, lora: bool = False, **overrides):
    """(model, optimizer, scheduler) for a sharded tiny Llama."""
    model = make_tiny_model("llama", seed=seed, **overrides)
    if lora:
        model = make_lora(model)
    model = shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def train_step(model: nn.Module, optimizer, scheduler) -> float:
    """One step on a batch drawn from the global RNG, so a resume must restore the RNG to match."""
    ids = torch.randint(0, 131, (BATCH, SEQ_LEN))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor (on every rank)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone().cpu() for k, v in state.items()}


def full_optim_state(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Optimizer tensors as full CPU tensors, flattened to "state.<fqn>.<name>" keys."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"state.{fqn}.{name}": v.detach().clone().cpu()
            for fqn, entry in state["state"].items() for name, v in entry.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
