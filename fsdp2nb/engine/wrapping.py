"""Which modules become FSDP units, and in what order fully_shard is applied.

Units, innermost first:
  * every transformer block whose class is named in `_no_split_modules` (all declared classes, so a
    vision tower and a text decoder both get per-block units);
  * the untied input embedding on its own;
  * the untied output head together with the final norm just before it (they run back to back, and
    backward needs them first, so they are kept gathered between forward and backward);
  * the root, which takes whatever is left (a tied embedding/head pair lives here, so the one shared
    tensor is managed by exactly one unit).

Backward runs the units in reverse: the head first, then the last block. Neither is resharded
after forward (as torchtitan leaves them): resharding would only gather them again at once
(benchmarks/bench_last_block.py measures it).

LoRA (peft) adapters are not wrapped on their own: their lora_A/lora_B sit inside the block that owns
the adapted Linear and are sharded with it. Checked by tests/distributed/test_engine_training.py:
fully_shard accepts frozen base weights and trainable adapters in one unit, and frozen bf16 base
weights next to fp32 adapters when the policy's param_dtype is bf16 (FSDP only requires one
original dtype among the *trainable* parameters of a unit), so no extra per-block adapter unit is needed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp2nb.errors import InvalidValue

logger = logging.getLogger(__name__)


def block_class_names(model: nn.Module) -> set[str]:
    """The class names listed in `_no_split_modules` anywhere in `model` (peft wrappers included)."""
    names: set[str] = set()
    for module in model.modules():
        declared = getattr(module, "_no_split_modules", None)
        if declared:
            names.update(declared)
    return names


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Every module whose class is a declared block class, outermost only, in registration order."""
    names = block_class_names(model)
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward; must run before fully_shard."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None or not getattr(_base_model(model), "supports_gradient_checkpointing", False):
        raise InvalidValue(
            f"activation_checkpointing=True is not allowed for {type(model).__name__}: it has no "
            "per-block gradient checkpointing; allowed: activation_checkpointing=False"
        )
    # Non-reentrant checkpointing needs no requires_grad inputs (LoRA with frozen embeddings works).
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _final_norm(head_parent: nn.Module, blocks: list[nn.Module]) -> nn.Module | None:
    """The `norm` module that sits beside the block list (Llama/Qwen/Mistral naming), if any."""
    for module in head_parent.modules():
        children = dict(module.named_children())
        has_blocks = any(isinstance(c, nn.ModuleList) and blocks and blocks[0] in c for c in children.values())
        if has_blocks and isinstance(children.get("norm"), nn.Module):
            return children["norm"]
    return None


def embedding_and_head(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None, bool]:
    """(input embedding, output head, tied) where tied means both hold the same weight tensor."""
    base = _base_model(model)
    get_in = getattr(base, "get_input_embeddings", None)
    get_out = getattr(base, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    tied = (
        embedding is not None and head is not None
        and getattr(head, "weight", None) is not None
        and head.weight is embedding.weight
    )
    return embedding, head, tied


@dataclass(frozen=True, slots=True)
class ShardUnit:
    """Modules that `fully_shard` makes one unit of: gathered together, resharded together."""

    modules: tuple[nn.Module, ...]
    kind: Literal["block", "embedding", "head", "root"]
    """The head (with the final norm) and the last block are never resharded after forward, and
    FSDP2 never reshards the root then either: backward starts with them."""


def shard_unit_list(model: nn.Module) -> list[ShardUnit]:
    """The units `shard_units` makes, innermost first and the root last; memory plans read it too."""
    units = [ShardUnit((block,), "block") for block in find_blocks(model)]
    embedding, head, tied = embedding_and_head(model)
    if not tied:
        if embedding is not None:
            units.append(ShardUnit((embedding,), "embedding"))
        if head is not None:
            norm = _final_norm(_base_model(model), [u.modules[0] for u in units if u.kind == "block"])
            units.append(ShardUnit((norm, head) if norm is not None else (head,), "head"))
    units.append(ShardUnit((model,), "root"))
    return units


def shard_units(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool,
) -> nn.Module:
    """Apply fully_shard to blocks, embedding, head (+ final norm) and finally the root."""
    common = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy or OffloadPolicy())
    units = shard_unit_list(model)
    if units[0].kind != "block":
        logger.warning("%s declares no _no_split_modules blocks; sharding it as one unit", type(model).__name__)
    kept_gathered = _needed_first_by_backward(units)
    for index, unit in enumerate(units):
        reshard = reshard_after_forward and index not in kept_gathered
        fully_shard(unit.modules[0] if len(unit.modules) == 1 else list(unit.modules),
                    reshard_after_forward=reshard, **common)
    _, _, tied = embedding_and_head(model)
    num_blocks = sum(unit.kind == "block" for unit in units)
    logger.info("sharded %d blocks (%s), tied embeddings: %s", num_blocks, sorted(block_class_names(model)), tied)
    return model


def _needed_first_by_backward(units: list[ShardUnit]) -> set[int]:
    """Indices of the head and the last block: resharding them after forward would only gather
    them again as backward starts."""
    blocks = [index for index, unit in enumerate(units) if unit.kind == "block"]
    return {index for index, unit in enumerate(units) if unit.kind == "head"} | set(blocks[-1:])


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """bf16: gather and compute in bf16, reduce gradients in fp32; fp32: no casting at all."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(offload_params: bool, pin_memory: bool) -> OffloadPolicy | None:
    return CPUOffloadPolicy(pin_memory=pin_memory) if offload_params else None


def cast_frozen_parameters(params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
    """Store frozen parameters in the compute dtype: they are never updated, so fp32 copies would only cost memory."""
    for param in params:
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
