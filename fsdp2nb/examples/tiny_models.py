"""Tiny Llama-, Qwen- and Gemma-style causal LMs built from a config and saved as real checkpoints.

The sizes are deliberately awkward: hidden 30, intermediate 70 and vocabulary 131 divide by
neither 4 nor (for the vocabulary) 2, so uneven FSDP shards are exercised on 2-4 ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from fsdp2nb.errors import InvalidValue

Family = Literal["llama", "qwen2", "gemma"]
CheckpointFormat = Literal["safetensors", "sharded", "bin"]
TINY_FAMILIES: tuple[Family, ...] = ("llama", "qwen2", "gemma")

_TINY_DIMS = dict(
    vocab_size=131,
    hidden_size=30,
    intermediate_size=70,
    num_hidden_layers=2,
    num_attention_heads=3,  # head_dim 10: rotary needs an even head size
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def tiny_config(family: Family = "llama", *, tie_word_embeddings: bool = False, **overrides):
    """A transformers config for a tiny model of `family`; `overrides` replace any dimension."""
    from transformers import GemmaConfig, LlamaConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gemma": GemmaConfig}.get(family)
    if config_cls is None:
        raise InvalidValue(f"family={family!r} is not one of {TINY_FAMILIES}")
    dims = {**_TINY_DIMS, **overrides}
    if family == "gemma":  # its head size is set apart from hidden / heads (default 256); its
        # embedding scale is a buffer the checkpoint does not hold
        dims.setdefault("head_dim", dims["hidden_size"] // dims["num_attention_heads"])
    return config_cls(**dims, tie_word_embeddings=tie_word_embeddings)


def make_tiny_model(family: Family = "llama", *, tie_word_embeddings: bool = False, seed: int = 0, **overrides):
    """A randomly initialised fp32 tiny causal LM on CPU, reproducible from `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, tie_word_embeddings=tie_word_embeddings, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_checkpoint(
    directory: str | os.PathLike,
    family: Family = "llama",
    *,
    tie_word_embeddings: bool = False,
    checkpoint_format: CheckpointFormat = "safetensors",
    seed: int = 0,
    with_tokenizer: bool = True,
    **overrides,
) -> Path:
    """Save a tiny model as a Hugging Face checkpoint directory and return its path.

    `checkpoint_format`: one `model.safetensors`, several safetensors files with an index
    (`sharded`), or `pytorch_model.bin`.
    """
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a progress bar for a 100 kB file is noise
    directory = Path(directory)
    model = make_tiny_model(family, tie_word_embeddings=tie_word_embeddings, seed=seed, **overrides)
    if checkpoint_format == "safetensors":
        model.save_pretrained(directory)
    elif checkpoint_format == "sharded":
        model.save_pretrained(directory, max_shard_size="20KB")
    elif checkpoint_format == "bin":
        # transformers 5 writes safetensors only; a legacy .bin is written the way older releases did.
        import torch

        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    else:
        raise InvalidValue(f"checkpoint_format={checkpoint_format!r} is not one of safetensors, sharded, bin")
    if with_tokenizer:
        make_tiny_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


def make_tiny_tokenizer(vocab_size: int = _TINY_DIMS["vocab_size"]):
    """A byte-level tokenizer built in memory: ids 3.. are the first bytes, 0-2 are special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    byte_tokens = [chr(c) for c in range(32, 32 + vocab_size - len(specials))]
    vocab = {token: i for i, token in enumerate(specials + byte_tokens)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
