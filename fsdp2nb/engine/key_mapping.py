"""Match model state-dict keys to checkpoint keys.

Three renamings separate the two: peft wraps the model (`base_model.model.` prefix, `.base_layer`
inside adapted modules, `.original_module`/`.modules_to_save.<adapter>` in modules it trains whole), transformers' conversion mapping renames legacy checkpoint keys (for
Llama/Qwen2 only the generic legacy rules such as `LayerNorm.gamma` -> `LayerNorm.weight`), and a
checkpoint of the bare decoder lacks (or has) the `model.` base-model prefix.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from torch import nn

from fsdp2nb.errors import UsageMistake

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."


def unwrap_peft(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the transformers model inside `model`, whether `model` is a peft wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and hasattr(model, "peft_config"):
        return get_base(), True
    return model, False


# peft's `modules_to_save` keeps the module twice: the original and a trainable copy per adapter.
_SAVED_MODULE_COPY = re.compile(r"\.(?:original_module|modules_to_save\.[^.]+)\.")


def hf_key(model_key: str, is_peft: bool) -> str:
    """The key the plain transformers model uses for `model_key`."""
    if not is_peft:
        return model_key
    key = model_key.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
    return _SAVED_MODULE_COPY.sub(".", key) if "module" in key else key


def checkpoint_to_model_keys(hf_model: nn.Module, checkpoint_keys: Iterable[str], model_keys: Iterable[str]) -> dict[str, str]:
    """Map each model (transformers) key to the checkpoint key that holds it.

    Raises ValueError when a checkpoint key needs a tensor conversion (merging or splitting
    tensors, e.g. fused MoE experts): such keys cannot be read slice by slice.
    """
    wanted = dict.fromkeys(model_keys, True)
    prefix = getattr(hf_model, "base_model_prefix", "") or None
    rules: tuple[list, list] | None = None
    mapping: dict[str, str] = {}
    for key in checkpoint_keys:
        if key in wanted:
            # Already the model's own name: skip transformers' pattern rules, which compile
            # hundreds of regular expressions (a visible part of a load, on every rank)
            # and are only built once a key needs them.
            mapping.setdefault(key, key)
            continue
        rules = rules or _conversion_rules(hf_model)
        renamed, converter = _rename(key, *rules, prefix, wanted)
        if converter is not None:
            raise UsageMistake(
                f"checkpoint key {key!r} needs transformers' tensor conversion {converter!r}, which "
                "init='meta' does not slice; use init='rank0' or init='default' for this model"
            )
        mapping.setdefault(renamed, key)
    return mapping


def _conversion_rules(hf_model: nn.Module) -> tuple[list, list]:
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers 4.x: checkpoints use the model's own names
        return [], []
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters


def _rename(key: str, renamings: list, converters: list, prefix: str | None, wanted: dict[str, bool]) -> tuple[str, str | None]:
    if renamings or converters:
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(key, renamings, converters, base_model_prefix=prefix, meta_state_dict=wanted)
    if prefix and key not in wanted:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in wanted:
            return key[len(prefix) + 1:], None
        if f"{prefix}.{key}" in wanted:
            return f"{prefix}.{key}", None
    return key, None
