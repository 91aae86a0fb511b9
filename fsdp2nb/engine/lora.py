"""Attach peft LoRA adapters, with identical initial values on every rank.

On a meta-built model peft creates the adapters on meta too (it moves them to the base layer's
device), which loses their initial values. `materialize_adapter_init` re-runs peft's own
initialisation on CPU copies of the adapter modules only, keeps the full tensors (small: r x d)
and puts the modules back on meta; the sharded loader later copies each rank's slice in.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp2nb.collectives import is_distributed
from fsdp2nb.errors import UsageMistake

logger = logging.getLogger(__name__)

_META_INIT_CHOICES: tuple[Any, ...] = (True, False, "gaussian")


def shared_seed() -> int:
    """A seed drawn on rank 0 and sent to all ranks, so every rank initialises adapters alike."""
    seed = [int(torch.randint(0, 2**62, (1,)).item())]
    if is_distributed():
        dist.broadcast_object_list(seed, src=0)
    return seed[0]


def apply_lora(model: nn.Module, lora_config: Any, *, seed: int) -> nn.Module:
    """Wrap `model` with `lora_config` (a peft.LoraConfig); base weights are frozen by peft."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, lora_config)


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _check_meta_supported(layer: nn.Module, adapter: str, init: Any) -> None:
    unsupported = (
        init not in _META_INIT_CHOICES
        or layer.use_dora.get(adapter, False)
        or adapter in layer.lora_embedding_A
    )
    if unsupported:
        raise UsageMistake(
            f"init='meta' supports LoRA on Linear layers with init_lora_weights in {_META_INIT_CHOICES} "
            f"and no DoRA; got init_lora_weights={init!r}, use_dora={layer.use_dora.get(adapter)}; "
            "use init='rank0' for this adapter"
        )


@torch.no_grad()
def materialize_adapter_init(model: nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """Full initial values of every LoRA adapter parameter of a meta model, keyed by model key."""
    # Module objects keep their identity through to_empty/to("meta"); parameter objects may not.
    module_names = {id(m): n for n, m in model.named_modules()}
    values: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in _lora_layers(model):
            for adapter in list(layer.lora_A):
                init = model.peft_config[adapter].init_lora_weights
                _check_meta_supported(layer, adapter, init)
                parts = (layer.lora_A[adapter], layer.lora_B[adapter])
                for part in parts:
                    part.to_empty(device="cpu")
                    # What peft's layers start from before its own initialisation, which
                    # init_lora_weights=False skips: without this they would hold to_empty's garbage.
                    part.reset_parameters()
                layer.reset_lora_parameters(adapter, init)
                for part in parts:
                    prefix = module_names[id(part)]
                    values.update({f"{prefix}.{n}": p.detach().clone() for n, p in part.named_parameters()})
                    part.to("meta")
    logger.debug("initialised %d LoRA tensors on CPU", len(values))
    return values
