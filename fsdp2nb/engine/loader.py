"""load_model: from a path or Hub id to a sharded model ready to train, in one call."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp2nb import progress
from fsdp2nb.config_checks import check_bool, check_choice
from fsdp2nb.engine.config import INIT_CHOICES
from fsdp2nb.engine.engine import FSDP2Engine
from fsdp2nb.engine.hf_files import find_checkpoint_files, refuse_quantized
from fsdp2nb.engine.hub import resolve_model_dir
from fsdp2nb.engine.loaded_model import note_loaded
from fsdp2nb.engine.lora import apply_lora, materialize_adapter_init, shared_seed
from fsdp2nb.engine.mesh import InvalidMesh, require_process_group
from fsdp2nb.engine.wrapping import cast_frozen_parameters

logger = logging.getLogger(__name__)

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_model(
    name_or_path: str | os.PathLike,
    *,
    init: str = "meta",
    lora: Any = None,
    activation_checkpointing: bool = False,
    engine: FSDP2Engine | None = None,
    mesh: DeviceMesh | None = None,
    allow_missing: Sequence[str] = (),
) -> tuple[nn.Module, Any]:
    """Load a causal LM sharded over all ranks, plus its tokenizer or processor (None if it has none).

    `init`: "meta" (each rank reads its own slices), "rank0" (rank 0 reads, the rest receive a
    broadcast) or "default" (every rank runs from_pretrained). `lora` is a peft.LoraConfig.
    `engine` says how to shard: precision, offload, resharding (default: `FSDP2Engine()`, bf16
    compute), e.g. `engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32")`. `mesh` is the engine's
    mesh (default: every rank shards), e.g. `mesh=fsdp2nb.hsdp_mesh()` for HSDP; with `engine`,
    give the mesh to the engine instead. `allow_missing` lists fnmatch patterns of keys that may
    be absent (init="meta").
    """
    check_choice("init", init, INIT_CHOICES)
    check_bool("activation_checkpointing", activation_checkpointing)
    require_process_group("load_model")
    engine = _engine_for(engine, mesh)
    directory = resolve_model_dir(name_or_path)
    refuse_quantized(Path(directory))  # from_pretrained would try to quantize or dequantize it
    task = _whole_load_progress(directory, init)
    try:
        model = _load_and_shard(directory, init, lora, engine, activation_checkpointing, allow_missing)
    except BaseException as error:
        task.finish(error)
        raise
    if task is not progress.SILENT:
        task.advance(task.total_bytes)
    task.finish()
    note_loaded(model)  # an out-of-memory report splits what the rank holds by it
    return model, load_processor(directory)


def _engine_for(engine: FSDP2Engine | None, mesh: DeviceMesh | None) -> FSDP2Engine:
    if engine is None:
        return FSDP2Engine(mesh=mesh)
    if mesh is not None and mesh is not engine.mesh:
        raise InvalidMesh("load_model got both engine= and a mesh= other than the engine's; pass the mesh to "
                          "the engine alone: engine=fsdp2nb.FSDP2Engine(..., mesh=mesh)")
    return engine


def _load_and_shard(directory: str, init: str, lora: Any, engine: FSDP2Engine,
                    activation_checkpointing: bool, allow_missing: Sequence[str]) -> nn.Module:
    model = _build(directory, init)
    initial_values: dict[str, torch.Tensor] = {}
    if lora is not None:
        seed = shared_seed()
        model = apply_lora(model, lora, seed=seed)
        if init == "meta":
            initial_values = materialize_adapter_init(model, seed=seed)
    # Frozen weights never change: keep them in the compute dtype; trainable ones stay fp32.
    cast_frozen_parameters(model.parameters(), engine.compute_dtype)
    engine.shard_model(
        model, directory, activation_checkpointing=activation_checkpointing,
        allow_missing=allow_missing, initial_values=initial_values,
    )
    return model


def _whole_load_progress(directory: str, init: str) -> progress.AnyTask:
    """init="rank0"/"default" read through from_pretrained, which reports nothing on the way: the
    bar shows the bytes this rank reads, at the start and at the end. A meta load reports per file."""
    if init == "meta" or not progress.listening():
        return progress.SILENT
    reads = init == "default" or dist.get_rank() == 0
    files = find_checkpoint_files(directory)
    total = sum((files.directory / name).stat().st_size for name in set(files.key_to_file.values())) if reads else 0
    return progress.start_task("load_model", "loading model weights (from_pretrained)", total, 0)


def _build(directory: str, init: str) -> nn.Module:
    """The model with real weights where `init` wants them and on meta elsewhere, fp32 storage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    real = init == "default" or (init == "rank0" and dist.get_rank() == 0)
    if real:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config._name_or_path = directory
    return model


def load_processor(directory: str | os.PathLike) -> Any:
    """AutoProcessor where a processor config exists, else AutoTokenizer where tokenizer files exist, else None."""
    path = Path(directory)
    if any((path / name).is_file() for name in _PROCESSOR_FILES):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return None
