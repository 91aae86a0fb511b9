"""Validated settings for FSDP2Engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp2nb.config_checks import check_bool, check_choice
from fsdp2nb.errors import InvalidValue

MixedPrecision = Literal["bf16", "fp32"]

MIXED_PRECISION_CHOICES: tuple[str, ...] = ("bf16", "fp32")
INIT_CHOICES: tuple[str, ...] = ("meta", "rank0", "default")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How FSDP2Engine shards, casts and places a model."""

    mixed_precision: MixedPrecision = "bf16"
    """Compute dtype of gathered parameters: "bf16" (fp32 storage and gradient reduction) or "fp32"."""

    reshard_after_forward: bool = True
    """Free gathered block parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2)."""

    offload_params: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA ranks only)."""

    pin_memory: bool = True
    """Pin offloaded CPU memory so host-device copies can overlap; only used with offload_params."""

    def __post_init__(self) -> None:
        check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION_CHOICES)
        check_bool("reshard_after_forward", self.reshard_after_forward)
        check_bool("offload_params", self.offload_params)
        check_bool("pin_memory", self.pin_memory)


def check_offload_supported(offload_params: bool, device_type: str, backend_config: str) -> None:
    """Refuse CPU offload where it cannot work, with a message that says what to do instead.

    `backend_config` is `torch.distributed.get_backend_config()`, e.g. "cuda:nccl,cpu:gloo".
    """
    if not offload_params:
        return
    if device_type == "cpu":
        raise InvalidValue(
            "offload_params=True is not allowed on CPU ranks (parameters already live in CPU memory); "
            "allowed: offload_params=False on device type 'cpu'"
        )
    # Offloaded shards are CPU tensors: gradient-norm and state-dict collectives on them need a CPU backend.
    if "cpu:" not in backend_config and "gloo" not in backend_config:
        raise InvalidValue(
            f"offload_params=True needs a process group with a CPU backend, but the backend is "
            f"{backend_config!r}; initialise it with backend='cuda:nccl,cpu:gloo'"
        )
