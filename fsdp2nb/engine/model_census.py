"""The model a memory plan reads: built on the meta device from its config, as `load_model`
builds it, and each parameter as sharding sees it.

Shapes only, no weights read: peft's LoRA adapters attached, frozen weights cast to the compute
dtype, trainable ones kept in fp32, cut into the units `wrapping.shard_unit_list` gives the
engine. Of blocks alike only two are kept, the second standing for the rest, so that a model of
80 layers is planned as cheaply as one of 2. `rows_per_rank` is FSDP2's split of a dim 0.
Nothing here knows a plan's settings: memory_plan.py turns these shapes into each rank's bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp2nb.engine import wrapping
from fsdp2nb.errors import InvalidValue


def load_config(source: Any) -> tuple[Any, str]:
    """(transformers config, name) from a config, a directory, a config.json or a cached Hub id."""
    from transformers import AutoConfig, PretrainedConfig

    from fsdp2nb.engine.hub import looks_like_a_path

    if isinstance(source, PretrainedConfig):
        config, name = source, source._name_or_path or type(source).__name__
    else:
        name = os.fspath(source)
        if os.path.exists(name):
            config = AutoConfig.from_pretrained(name)
        elif looks_like_a_path(name):
            raise InvalidValue(f"{name!r} does not exist; give a model directory, its config.json, or a Hub id")
        else:
            try:
                config = AutoConfig.from_pretrained(name, local_files_only=True)
            except OSError:
                raise InvalidValue(f"{name!r} is not in the local Hugging Face cache, and a plan downloads nothing: "
                                 f"fetch its config first (`hf download {name} config.json`) or give a path") from None
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
        raise InvalidValue(f"{name} is a quantized checkpoint (quant_method={method!r}); the engine trains "
                         "unquantized weights: plan the bf16/fp16/fp32 release of this model")
    return config, name


@dataclass(frozen=True)
class PlannedModel:
    """The meta model a plan reads, with repeated blocks left out (`keep_representative_blocks`)."""

    model: nn.Module
    block_counts: dict[int, int]
    """id(kept block) -> how many blocks of the whole model it stands for (itself included)."""

    def count(self, module: nn.Module) -> int:
        return self.block_counts.get(id(module), 1)


def build_meta_model(config: Any, lora_config: Any, dtype: torch.dtype) -> PlannedModel:
    """The model as `load_model` builds it, on meta: fp32, adapters attached, frozen weights in
    `dtype`; of blocks alike only two are kept, the second standing for the rest."""
    from transformers import AutoModelForCausalLM

    from fsdp2nb.engine.lora import apply_lora

    with torch.device("meta"):  # peft's adapters too: made and initialised on CPU they cost seconds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        counts = keep_representative_blocks(model)
        if lora_config is not None:  # peft replaces Linears inside the blocks: the blocks stay
            model = apply_lora(model, lora_config, seed=0)
    wrapping.cast_frozen_parameters(model.parameters(), dtype)
    return PlannedModel(model.train(), counts)


_INDEX_ATTRIBUTES = frozenset(("layer_idx", "layer_id", "layer_number", "idx"))
"""Attributes that number a block: blocks alike but for them are alike."""


def block_signature(block: nn.Module) -> tuple:
    """What makes two blocks plan alike: every submodule's class, parameter shapes and scalar
    settings (an attention's layer type or sliding window, say), not its index."""
    parts = []
    for name, module in block.named_modules():
        settings = tuple(sorted((key, value) for key, value in vars(module).items()
                                if isinstance(value, (str, int, float, bool, type(None)))
                                and not key.startswith("_") and key not in _INDEX_ATTRIBUTES))
        params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters(recurse=False))
        parts.append((name, type(module).__name__, settings, params))
    return tuple(parts)


def keep_representative_blocks(model: nn.Module) -> dict[int, int]:
    """Drop all but two of each kind of block (`block_signature`) from the ModuleLists that hold
    them, so that peft and the traced forward cost the same for 80 layers as for 2; return
    id(kept block) -> how many it stands for. Two, not one, tell a block's own inputs (its
    hidden states) from those every block shares (rotary tables, masks)."""
    blocks = wrapping.find_blocks(model)
    groups: dict[tuple, list[nn.Module]] = {}
    for block in blocks:
        groups.setdefault(block_signature(block), []).append(block)
    counts: dict[int, int] = {}
    for members in groups.values():
        counts[id(members[0])] = 1
        if len(members) > 1:
            counts[id(members[1])] = len(members) - 1
    block_ids = {id(block) for block in blocks}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.ModuleList) and any(id(child) in block_ids for child in module):
            kept = [child for child in module if id(child) not in block_ids or id(child) in counts]
            parent_name, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attribute, nn.ModuleList(kept))
    return {key: count for key, count in counts.items() if count > 1}


# --- sharded state ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParamShape:
    """One parameter as sharding sees it."""

    rows: int
    """Its dim 0, which FSDP2 splits."""
    row_numel: int
    itemsize: int
    """Bytes per element as stored: fp32 if trained, the compute dtype if frozen."""
    trainable: bool
    floating: bool
    unit: int
    """Index of its unit in `ParamLayout.unit_kinds`."""
    count: int = 1
    """How many of the whole model's parameters it stands for (a kept block's)."""


@dataclass(frozen=True, slots=True)
class ParamLayout:
    params: tuple[ParamShape, ...]
    unit_kinds: tuple[str, ...]
    """Each unit's kind ("block", "embedding", "head", "root"), innermost first."""
    unit_counts: tuple[int, ...]
    """How many units of the whole model each stands for."""

    def all_frozen(self, itemsize: int) -> ParamLayout:
        """The same weights frozen and stored at `itemsize` bytes: LoRA's base model, adapters left out."""
        params = tuple(dataclasses.replace(p, trainable=False, itemsize=itemsize if p.floating else p.itemsize)
                       for p in self.params)
        return ParamLayout(params, self.unit_kinds, self.unit_counts)


def param_layout(planned: PlannedModel) -> ParamLayout:
    units = wrapping.shard_unit_list(planned.model)
    unit_of: dict[int, int] = {}
    for index, unit in enumerate(units):
        for module in unit.modules:
            for param in module.parameters():
                unit_of.setdefault(id(param), index)
    counts = tuple(planned.count(unit.modules[0]) for unit in units)
    params = []
    for param in planned.model.parameters():
        rows = param.shape[0] if param.dim() else 1
        unit = unit_of[id(param)]
        params.append(ParamShape(rows=rows, row_numel=param.numel() // rows if rows else 0,
                                 itemsize=param.element_size(), trainable=param.requires_grad,
                                 floating=param.is_floating_point(), unit=unit, count=counts[unit]))
    return ParamLayout(tuple(params), tuple(unit.kind for unit in units), counts)


@functools.lru_cache(maxsize=4096)
def rows_per_rank(rows: int, world_size: int) -> tuple[int, ...]:
    """Each rank's rows of a dim 0 of `rows`: `torch.chunk`'s split, which FSDP2 uses, with 0 for
    ranks past the last chunk."""
    chunks = torch.chunk(torch.empty(rows, device="meta"), world_size)
    sizes = [len(chunk) for chunk in chunks]
    return tuple(sizes + [0] * (world_size - len(sizes)))
