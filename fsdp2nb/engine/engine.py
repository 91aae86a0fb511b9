"""FSDP2Engine: shard a transformers model with fully_shard and load it."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from fsdp2nb.engine import wrapping
from fsdp2nb.engine.buffers import recompute_non_persistent_buffers
from fsdp2nb.engine.config import EngineConfig, check_offload_supported
from fsdp2nb.engine.device import current_device
from fsdp2nb.engine.hf_files import find_checkpoint_files
from fsdp2nb.engine.mesh import check_mesh, flat_mesh, require_process_group
from fsdp2nb.engine.sharded_load import LoadReport, load_sharded
from fsdp2nb.errors import InvalidValue, UsageMistake
from fsdp2nb.module_buffers import non_persistent_buffer_names

logger = logging.getLogger(__name__)




class FSDP2Engine:
    """Shards models with FSDP2 (`fully_shard`) and loads checkpoints into them.

    `mesh`: every rank along one dimension (default: FSDP), or a 2-D `("replicate", "shard")`
    mesh for HSDP (`fsdp2nb.hsdp_mesh()`): parameters are then `(Replicate(), Shard(0))`.
    """

    def __init__(
        self,
        *,
        mixed_precision: str = "bf16",
        reshard_after_forward: bool = True,
        offload_params: bool = False,
        pin_memory: bool = True,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.config = EngineConfig(
            mixed_precision=mixed_precision, reshard_after_forward=reshard_after_forward,
            offload_params=offload_params, pin_memory=pin_memory,
        )
        require_process_group("FSDP2Engine")
        self.device = current_device()
        self.mesh = flat_mesh(self.device.type) if mesh is None else check_mesh(mesh, self.device.type)
        check_offload_supported(self.config.offload_params, self.mesh.device_type, dist.get_backend_config())
        self.last_load_report: LoadReport | None = None
        """What the most recent `materialize_and_load` read, for logging and benchmarks."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype parameters are gathered and used in."""
        return torch.bfloat16 if self.config.mixed_precision == "bf16" else torch.float32

    @property
    def _storage_device(self) -> torch.device:
        """Where sharded parameters live: CPU memory when offloaded, else this rank's device."""
        return torch.device("cpu") if self.config.offload_params else self.device

    def prepare_model(self, model: nn.Module, *, activation_checkpointing: bool = False) -> nn.Module:
        """Apply activation checkpointing (optional) and then fully_shard, block by block, then the root."""
        if activation_checkpointing:
            wrapping.apply_activation_checkpointing(model)
        return wrapping.shard_units(
            model, mesh=self.mesh,
            mp_policy=wrapping.mixed_precision_policy(self.config.mixed_precision),
            offload_policy=wrapping.offload_policy(self.config.offload_params, self.config.pin_memory),
            reshard_after_forward=self.config.reshard_after_forward,
        )

    def shard_model(
        self,
        model: nn.Module,
        checkpoint_dir: str | os.PathLike | None = None,
        *,
        activation_checkpointing: bool = False,
        allow_missing: Sequence[str] = (),
        initial_values: dict[str, torch.Tensor] | None = None,
    ) -> nn.Module:
        """Shard `model` and give every rank its weights; the path follows where the weights are.

        * every rank on meta: shard, then each rank reads its own slices of `checkpoint_dir`
          (default: the model config's `_name_or_path`);
        * rank 0 real, others on meta: shard, then broadcast rank 0's full weights;
        * every rank real: shard the weights each rank already has.
        """
        layout = self._weight_layout(model)
        if layout == "rank0":
            full_state = model.state_dict() if dist.get_rank() == 0 else {}
            self.prepare_model(model, activation_checkpointing=activation_checkpointing)
            return self._broadcast_from_rank0(model, full_state)
        self.prepare_model(model, activation_checkpointing=activation_checkpointing)
        if layout == "meta":
            path = checkpoint_dir or getattr(getattr(model, "config", None), "_name_or_path", None)
            if not path:
                raise InvalidValue("checkpoint_dir=None is not allowed for a meta model without config._name_or_path")
            self.materialize_and_load(model, path, allow_missing=allow_missing, initial_values=initial_values)
        return model

    def _weight_layout(self, model: nn.Module) -> str:
        on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        flags: list[bool] = [False] * dist.get_world_size()
        dist.all_gather_object(flags, on_meta)
        if all(flags):
            return "meta"
        if not any(flags):
            return "default"
        if not flags[0] and all(flags[1:]):
            return "rank0"
        raise UsageMistake(f"unsupported weight layout: ranks on meta are {[r for r, f in enumerate(flags) if f]}; "
                           "allowed: all ranks, none, or all but rank 0")

    @torch.no_grad()
    def materialize_and_load(
        self,
        model: nn.Module,
        path: str | os.PathLike,
        *,
        allow_missing: Sequence[str] = (),
        initial_values: dict[str, torch.Tensor] | None = None,
    ) -> nn.Module:
        """Allocate a sharded meta model on this rank's device and read its slices from `path`."""
        from fsdp2nb.engine.hub import resolve_model_dir

        files = find_checkpoint_files(resolve_model_dir(path))
        model.to_empty(device=self._storage_device)
        self.last_load_report = load_sharded(
            model, files, initial_values=initial_values, allow_missing=allow_missing
        )
        recompute_non_persistent_buffers(model, self.device)
        move_buffers(model, self.device)
        verify_tied_embeddings(model)
        logger.info("rank %d loaded %d tensors from %s (%d bytes requested)", dist.get_rank(),
                    self.last_load_report.num_loaded, path, self.last_load_report.bytes_requested)
        return model

    def _broadcast_from_rank0(self, model: nn.Module, full_state: dict[str, torch.Tensor]) -> nn.Module:
        if dist.get_rank() != 0:
            model.to_empty(device=self._storage_device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full_state, options=options)
        # Rank 0's buffers are real; the other ranks rebuild theirs the same way from_pretrained does.
        recompute_non_persistent_buffers(model, self.device)
        move_buffers(model, self.device)
        verify_tied_embeddings(model)
        return model


@torch.no_grad()
def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Put every buffer on the compute device; offloading covers parameters only, and
    to_empty on CPU put the buffers there too."""
    non_persistent = set(non_persistent_buffer_names(model))  # once for the model, not per buffer
    for prefix, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.device != device:
                qualified_name = f"{prefix}.{name}" if prefix else name
                module.register_buffer(name, buffer.to(device), persistent=qualified_name not in non_persistent)


def verify_tied_embeddings(model: nn.Module) -> None:
    """Raise if a model configured with tied embeddings no longer shares one weight tensor."""
    hf_model = model.get_base_model() if hasattr(model, "peft_config") else model
    config = getattr(hf_model, "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return
    _, _, tied = wrapping.embedding_and_head(model)
    if not tied:
        raise RuntimeError(  # internal: a loading bug, the user's input was valid
            f"rank {dist.get_rank()}: config.tie_word_embeddings=True but the input embedding and the "
            "output head hold different tensors after loading"
        )
