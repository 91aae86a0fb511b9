"""A tiny Llama loaded through `fsdp2nb.load_model` on the ranks, with an optimizer, a
Checkpointer and a seeded `train_step`: the set-up cell of the kernel and multi-host training tests.
The kernel's `model_dir` and `ckpt_dir` must have been pushed to the ranks first."""

from __future__ import annotations

import re

SETUP = """%%fsdp2
import fsdp2nb
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
if rank == 0:
    save_tiny_checkpoint(model_dir, "llama")
dist.barrier()
model, tokenizer = fsdp2nb.load_model(model_dir, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=2).track(model=model, optimizer=optimizer)

def train_step(step):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    fsdp2nb.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
"""


def losses(text: str) -> list[str]:
    """The losses a training cell printed ("loss 1.234567"), as text to compare exactly."""
    return re.findall(r"loss ([0-9.]+)", text)
