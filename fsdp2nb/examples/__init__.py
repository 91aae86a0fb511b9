"""What the example notebooks share: a short text to train on, a tiny model to train, and the
training set-up that a first run and a resume after `%fsdp2 restart` both call on the ranks.

Everything here runs without a network: the model is made from a config and saved as a real
checkpoint, the tokenizer is built in memory, the text ships with the package.
"""

from __future__ import annotations

import html
import os
import re
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fsdp2nb.errors import InvalidValue, NotReady

# peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps or loads a model: a
# warning for peft's authors, not for whoever runs the examples (ranks and kernel alike).
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

SAMPLE_TEXT_FILE = "keeper.txt"
"""A short story written for these examples (about 3.5 KB of plain ASCII)."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama- or Qwen-style block: a random tiny model learns little through
the attention projections alone."""


def sample_text() -> str:
    """The text the example notebooks train on, with its line breaks turned into spaces."""
    text = resources.files(__package__).joinpath(SAMPLE_TEXT_FILE).read_text(encoding="ascii")
    return " ".join(text.split())


def char_tokenizer() -> Any:
    """A tokenizer built in memory that gives each printable ASCII character one id (3-97; 0-2 are
    <pad>, <s> and </s>), so any English text can be trained on and generated without a download."""
    from tokenizers import decoders

    from fsdp2nb.examples.tiny_models import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(vocab_size=3 + 95)  # ' ' to '~'
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # decode "Th" as "Th", not "T h"
    return tokenizer


def save_tiny_llama(directory: str | os.PathLike, *, hidden_size: int = 128, num_hidden_layers: int = 2,
                    seed: int = 0) -> Path:
    """Save a randomly initialised Llama-style model and `char_tokenizer()` under `directory`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a progress bar for one small file is noise
    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 8 // 3,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory = Path(directory)
    model.save_pretrained(directory)  # model.safetensors + config.json: a real checkpoint
    tokenizer.save_pretrained(directory)
    return directory


def lora_config(rank: int = 16) -> Any:
    """The LoRA adapters the examples train: every linear layer of each block, alpha = 2 x rank."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS),
                      task_type="CAUSAL_LM")  # names the model class the export is loaded with


@dataclass(slots=True)
class Training:
    """What a rank trains with; `fsdp2nb.export_hf(model, path)` exports `model` in Hugging Face format."""

    engine: Any
    model: Any
    tokenizer: Any
    optimizer: Any
    ckpt: Any

    def train_step(self, batch: dict, step: int) -> float:
        """One step: forward, backward, gradient clipping, optimizer step; logs and returns the loss."""
        import fsdp2nb

        loss = self.model(**batch).loss
        loss.backward()
        fsdp2nb.clip_grad_norm_(self.model, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        fsdp2nb.log(step, loss=loss.item())
        return loss.item()


def setup_training(model_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, *, lora: bool = True,
                   lr: float = 5e-3, keep: int | None = 3, async_save: bool = True,
                   offload_params: bool = False) -> Training:
    """Load `model_dir` sharded over every rank and track it in a Checkpointer at `ckpt_dir`.

    Collective: run it on every rank (a `%%fsdp2` cell). bf16 compute on GPUs, fp32 on CPU ranks.
    """
    import torch

    import fsdp2nb
    from fsdp2nb.engine.device import current_device

    precision = "bf16" if current_device().type == "cuda" else "fp32"
    engine = fsdp2nb.FSDP2Engine(mixed_precision=precision, offload_params=offload_params)
    model, tokenizer = fsdp2nb.load_model(model_dir, lora=lora_config() if lora else None, engine=engine)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    ckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=keep, async_save=async_save).track(model=model, optimizer=optimizer)
    return Training(engine=engine, model=model, tokenizer=tokenizer, optimizer=optimizer, ckpt=ckpt)


def text_batches(tokenizer: Any, text: str, *, seq_len: int = 64, batch_size: int = 4, device: Any = "cpu",
                 seed: int = 0) -> Iterator[dict]:
    """Endless batches of `batch_size` windows of `seq_len` tokens of `text`, different on every rank.

    Window starts are drawn from a generator seeded by `seed` and the rank, so each rank trains
    on its own slice of the data (data parallelism) and a rerun draws the same windows.
    """
    import torch
    import torch.distributed as dist

    ids = tokenizer(text, return_tensors="pt").input_ids[0]  # (num_tokens,)
    if len(ids) <= seq_len:
        raise InvalidValue(f"seq_len={seq_len} must be shorter than the text ({len(ids)} tokens)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    while True:
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
        windows = torch.stack([ids[s:s + seq_len] for s in starts.tolist()]).to(device)  # (batch, seq_len)
        yield {"input_ids": windows, "labels": windows}


def text_windows(tokenizer: Any, text: str, *, seq_len: int = 64) -> list[dict]:
    """`text` cut into consecutive windows of `seq_len` tokens, each an example for
    `fsdp2nb.evaluate` ({"input_ids": [...]}); the last, shorter piece is left out."""
    ids = tokenizer(text).input_ids
    return [{"input_ids": ids[start:start + seq_len]} for start in range(0, len(ids) - seq_len + 1, seq_len)]


def press_save_now(wait_s: float = 30.0) -> str:
    """Press the shown dashboard's **Save now** as a click does; returns the panel's message line.

    For a notebook run headless, where nobody clicks (in JupyterLab, click the button). Run in
    the notebook's kernel: during a training cell the save is served at its next `maybe_save`.
    Waits up to `wait_s` for the panel to list the ranks' checkpointer, as a person would wait
    to see it before clicking (the ranks report it twice a second).
    """
    import fsdp2nb

    link = fsdp2nb._session.dashboard if fsdp2nb._session is not None else None
    if link is None or not link.views:
        raise NotReady("no dashboard is shown: run `%fsdp2 start` (without --no-dashboard) or `%fsdp2 dashboard` first")
    deadline = time.monotonic() + wait_s
    while link.model.checkpoint is None and time.monotonic() < deadline:
        time.sleep(0.1)
        link.tick()
    view = link.views[-1]
    view.save_button.click()
    return html.unescape(re.sub(r"<[^>]+>", "", view.message.value))
