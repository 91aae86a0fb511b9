"""What autograd saves in one forward with loss, traced on meta tensors: a memory plan's activations.

`saved_tensors_hooks` count each saved storage once, by the block that saved it first, leaving
the parameters out (FSDP2 frees its gathered copies after forward); each block's inputs are
noted too, which is what per-block checkpointing keeps. Attention is traced as the fused kernels
of GPUs and CPUs run it (output and log-sum-exp saved): the meta device would take the math path,
which saves the S x S scores. It reads only the model on meta (model_census.py), not a plan's
settings, so it stands apart from memory_plan.py.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fsdp2nb.engine import wrapping
from fsdp2nb.engine.model_census import PlannedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ActivationTrace:
    """What autograd saved in one traced forward, and what per-block checkpointing would keep."""

    saved_bytes: int
    """Everything saved, parameters left out."""
    checkpointed_bytes: int
    """With checkpointing: the blocks' inputs, what is saved outside blocks, and one block's
    activations while backward recomputes it."""
    batch_size: int
    """The batch traced; other batches scale the figures."""
    error: str | None = None
    """Why the forward could not be traced (the figures are then 0)."""

    def bytes(self, activation_checkpointing: bool, batch_size: int) -> int:
        traced = self.checkpointed_bytes if activation_checkpointing else self.saved_bytes
        return traced * batch_size // self.batch_size


class _SavedTensors:
    """`saved_tensors_hooks` packing that counts each storage once, by the block that saved it
    first, and notes each block's input tensors (what checkpointing keeps)."""

    def __init__(self, skipped: set[int]) -> None:
        self._skipped = skipped  # ids of the parameters' storages (kept alive by the model)
        self.saved: dict[int, tuple[torch.UntypedStorage, int | None]] = {}
        self.inputs: dict[int, tuple[torch.UntypedStorage, set[int]]] = {}  # storage -> blocks given it
        self._block: int | None = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in self._skipped and id(storage) not in self.saved:
            self.saved[id(storage)] = (storage, self._block)
        return tensor

    def enter(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._block = index
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in self._skipped:
                    storage = tensor.untyped_storage()
                    self.inputs.setdefault(id(storage), (storage, set()))[1].add(index)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._block = None

    def trace(self, counts: list[int], batch_size: int) -> ActivationTrace:
        """The whole model's figures: block `i` was traced once for `counts[i]` blocks alike."""
        per_block = [0] * len(counts)
        outside = outside_not_inputs = 0
        for key, (storage, block) in self.saved.items():
            if block is not None:
                per_block[block] += storage.nbytes()
            else:
                outside += storage.nbytes()
                outside_not_inputs += 0 if key in self.inputs else storage.nbytes()
        # A block's own input (its hidden states) is kept once per block; one given to several
        # blocks (rotary tables, a mask) once.
        kept_inputs = sum(storage.nbytes() * (counts[next(iter(blocks))] if len(blocks) == 1 else 1)
                          for storage, blocks in self.inputs.values())
        saved = outside + sum(n * count for n, count in zip(per_block, counts, strict=True))
        return ActivationTrace(saved_bytes=saved, batch_size=batch_size,
                               checkpointed_bytes=outside_not_inputs + kept_inputs + max(per_block, default=0))


class FusedAttention(TorchFunctionMode):
    """Runs `scaled_dot_product_attention` as the fused kernels do, so autograd saves what they
    save (query, key, value, output, log-sum-exp): on meta tensors PyTorch would take the math
    path, which saves the attention scores, batch x heads x S x S."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    # The CPU flash kernel's op has a meta implementation and autograd saves for it what the
    # CUDA flash and memory-efficient kernels save too; key/value with fewer heads (GQA) pass as they are.
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdpa does, for every fused kernel
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return output


def trace_activations(planned: PlannedModel, batch_size: int, seq_len: int, dtype: torch.dtype) -> ActivationTrace:
    """Run one forward with loss on meta tensors, parameters cast to the compute dtype (as FSDP2
    gathers them), and count what autograd saves. Casts the model's parameters in place."""
    model = planned.model
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    counter = _SavedTensors({id(p.untyped_storage()) for p in model.parameters()})
    blocks = [unit.modules[0] for unit in wrapping.shard_unit_list(model) if unit.kind == "block"]
    handles = [h for index, block in enumerate(blocks) for h in (
        block.register_forward_pre_hook(functools.partial(counter.enter, index), with_kwargs=True),
        block.register_forward_hook(counter.leave))]
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack), FusedAttention():
            # As a training step calls it. (use_cache=False would make transformers look for packed
            # sequences in the position ids, a question of values that meta tensors cannot answer.)
            model(input_ids=input_ids, labels=input_ids)
    except Exception as error:  # a model whose forward needs real values (data-dependent routing)
        logger.info("tracing the forward on meta failed", exc_info=True)
        return ActivationTrace(0, 0, batch_size, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    finally:
        for handle in handles:
            handle.remove()
    return counter.trace([planned.count(block) for block in blocks], batch_size)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
