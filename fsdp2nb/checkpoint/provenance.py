"""Who wrote a checkpoint, for its metadata: the library versions of the writer and, for a
trainable-only checkpoint, what it needs to be rebuilt (the base model, the adapter configs)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


def library_versions() -> dict[str, str]:
    """The versions of the libraries that wrote a checkpoint, for its metadata."""
    from importlib import metadata

    versions = {}
    for name in ("torch", "transformers", "peft", "fsdp2nb"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def rebuild_info(model: nn.Module) -> dict[str, object]:
    """What a trainable-only checkpoint needs besides itself: the base model and adapter configs."""
    info: dict[str, object] = {}
    config = getattr(model, "config", None)
    if config is not None:
        info["base_model_name_or_path"] = getattr(config, "_name_or_path", "")
        info["model_type"] = getattr(config, "model_type", "")
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict):
        info["peft_config"] = {name: _jsonable(cfg.to_dict()) for name, cfg in peft_config.items()}
    return info


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
