"""`fsdp2nb.generate`: completions for a list of prompts from a sharded model, the prompts spread
over the ranks and every completion back on every rank.

Called on every rank with the same prompts. Each rank takes its contiguous share (5 prompts on 2
GPU ranks: 3 and 2) and generates it in left-padded batches of at most `batch_size` with Hugging
Face's `generate`, on the whole model gathered once (`inference.as_planned`): no collective per
token, each rank at its own pace. On CPU ranks a batch goes to one rank, at most one rank per core
of the host decodes, on its part of the cores (8 prompts in one batch: one rank on every core),
and every decoding rank reads the one copy of the model in the host's shared memory.
Where the whole model does not fit, the ranks generate sharded with `synced_gpus=True`: a rank
whose sequences are done (or that has no prompt) keeps running forward passes until every rank is
done, so all run the same number and none waits in an all-gather the others never reach. Then one
exchange (`gathered_if_all_succeeded`) brings every rank's completions, or its error, to all, in
prompt order.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import torch
from torch import nn

from fsdp2nb.collectives import gathered_if_all_succeeded, get_rank
from fsdp2nb.engine.inference import (
    GatherPlan,
    InferenceInputError,
    as_planned,
    evaluating,
    item_share,
    max_gathered_bytes_from,
    model_device,
    plan_gathering,
)

DEFAULT_BATCH_SIZE = 32
"""The most prompts a rank decodes at once unless `batch_size` says otherwise: a longer share is
decoded batch after batch, so the KV cache and logits stay bounded whatever the list's length."""

STREAM_REDRAW_S = 0.1
"""A streamed line is redrawn at most ten times a second; the notebook shows it from its second
drawing and updates it at most five times a second (`frontend/line_updates.py`)."""


class GenerationInputError(InferenceInputError):
    """Prompts, tokenizer or settings that `fsdp2nb.generate` cannot use (one line says which)."""


def generate(model: nn.Module, tokenizer: Any, prompts: str | Sequence[str], *, stream: bool = False,
             batch_size: int = DEFAULT_BATCH_SIZE, max_gathered_bytes: int | None = None,
             **generate_kwargs: Any) -> str | list[str]:
    """The completion of each prompt (the text after it), on every rank, in prompt order.

    Collective: call it on every rank with the same prompts (a `%%fsdp2` cell). Example:
    `fsdp2nb.generate(model, tokenizer, ["Once", "The light"], max_new_tokens=32, do_sample=False)`.
    `generate_kwargs` go to the model's `generate` (`max_new_tokens` is required; `pad_token_id`
    defaults to the tokenizer's). `stream=True` shows the first prompt's text in the notebook as
    it is made, on one line: redrawn at most ten times a second, updated in the notebook at most
    five times, so a generation of a quarter of a second or more is seen to grow (a shorter one
    shows as one line once done). A string for `prompts` gives a string back. `batch_size`: the
    most prompts one rank decodes at once (default DEFAULT_BATCH_SIZE); a longer share is decoded
    batch after batch.

    The model is gathered whole on each rank for the duration and sharded again afterwards; where
    it would not fit in a rank's memory (or takes more than `max_gathered_bytes`, default
    FSDP2NB_MAX_GATHERED_BYTES) it stays sharded and the ranks generate in lockstep, rank 0 saying why.
    """
    prompt_list = _prompt_list(prompts)
    kwargs = _generate_kwargs(tokenizer, stream, generate_kwargs)
    _require_batch_size(batch_size)
    limit = max_gathered_bytes_from(max_gathered_bytes)
    with evaluating(model):
        plan, digests = plan_gathering(model, limit, local_facts=_digest(prompt_list),
                                       num_batches=-(-len(prompt_list) // batch_size))
        _require_same_prompts(digests)
        share = item_share(len(prompt_list), get_rank(), plan.working_ranks)
        error, completions = None, []
        try:
            with as_planned(model, plan, "fsdp2nb.generate"):
                for batch in _batches(share, len(prompt_list), batch_size, plan):
                    completions += _generate_batch(model, tokenizer, prompt_list, batch, plan, stream, kwargs)
        except Exception as exc:  # every rank hears of it below, rather than waiting in the gather
            error = exc
    everyone = [text for share_texts in gathered_if_all_succeeded(completions, error, "fsdp2nb.generate")
                for text in share_texts]  # the shares are contiguous, in rank order: prompt order
    return everyone[0] if isinstance(prompts, str) else everyone


def _prompt_list(prompts: str | Sequence[str]) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise GenerationInputError(f"prompts must be a string or a list of strings, not {type(prompts).__name__}")
    if not prompts:
        raise GenerationInputError("no prompts: pass a string or a non-empty list of strings")
    return list(prompts)


def _generate_kwargs(tokenizer: Any, stream: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What goes to `model.generate` besides the inputs, once the call's settings are checked."""
    if not isinstance(stream, bool):
        raise GenerationInputError(f"stream={stream!r} must be True or False")
    new_tokens = kwargs.get("max_new_tokens")
    if new_tokens is None:
        raise GenerationInputError("max_new_tokens is missing: pass e.g. max_new_tokens=64 (it bounds how long "
                                   "every rank generates)")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise GenerationInputError(f"max_new_tokens={new_tokens!r} must be an int >= 1")
    if "synced_gpus" in kwargs:
        raise GenerationInputError("synced_gpus is chosen by fsdp2nb.generate (True where the ranks generate "
                                   "sharded, in lockstep): leave it out")
    if stream and "streamer" in kwargs:
        raise GenerationInputError("stream=True and streamer= both stream: pass one of them")
    if getattr(tokenizer, "pad_token_id", None) is None:
        raise GenerationInputError("the tokenizer has no pad token, which a left-padded batch needs: set "
                                   "tokenizer.pad_token = tokenizer.eos_token (on every rank) and call again")
    return {"pad_token_id": tokenizer.pad_token_id, **kwargs}


def _digest(prompts: list[str]) -> tuple[int, int]:
    """The number of prompts and 63 bits of a hash of them: what the ranks compare."""
    return len(prompts), int(hashlib.sha256("\0".join(prompts).encode()).hexdigest()[:15], 16)


def _require_same_prompts(digests: list[tuple[int, ...]]) -> None:
    if any(digest != digests[0] for digest in digests):
        counts = ", ".join(f"rank {rank}: {count}" for rank, (count, _) in enumerate(digests))
        raise GenerationInputError(f"the ranks were given different prompts ({counts} prompts): pass the same "
                                   "list on every rank; each rank generates its share")


def _require_batch_size(batch_size: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise GenerationInputError(f"batch_size={batch_size!r} must be an int >= 1 (the most prompts a rank "
                                   "decodes at once)")


def _batches(share: range, num_prompts: int, batch_size: int, plan: GatherPlan) -> list[range]:
    """This rank's share cut into batches of at most `batch_size`. In lockstep every rank runs as
    many batches as the largest share needs, an empty range standing for each batch it lacks."""
    batches = [share[start:start + batch_size] for start in range(0, len(share), batch_size)]
    if plan.lockstep:
        largest = len(item_share(num_prompts, plan.working_ranks[0], plan.working_ranks))  # the first is largest
        batches += [range(0)] * (-(-largest // batch_size) - len(batches))
    return batches


def _generate_batch(model: nn.Module, tokenizer: Any, prompts: list[str], batch: range, plan: GatherPlan,
                    stream: bool, kwargs: dict[str, Any]) -> list[str]:
    """The completions of one batch of this rank's prompts. In lockstep an empty batch generates
    for the first prompt and drops the result: its forward passes are the collectives the other
    ranks wait in."""
    texts = [prompts[index] for index in batch] or prompts[:1]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left").to(model_device(model))
    streamer = FirstPromptLine(tokenizer, texts[0]) if stream and batch and batch.start == 0 else None
    output = model.generate(**inputs, synced_gpus=plan.lockstep, streamer=streamer, **kwargs)
    new_tokens = output[:, inputs["input_ids"].shape[1]:]  # (batch, new tokens): the text after the prompt
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True) if batch else []


class FirstPromptLine:
    """A `generate` streamer that shows the first row's prompt and completion on one line, redrawn
    with a carriage return as tokens come (the notebook updates such a line in place)."""

    def __init__(self, tokenizer: Any, prompt: str, out: TextIO | None = None,
                 min_interval_s: float = STREAM_REDRAW_S, clock=time.monotonic) -> None:
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._out = out
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._tokens: list[int] = []
        self._seen_prompt = False
        self._drawn_at = float("-inf")
        self._width = 0

    def put(self, value: torch.Tensor) -> None:
        """`generate` passes the prompts first ((batch, length)), then each step's tokens ((batch,))."""
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self._tokens.append(int(value.reshape(-1)[0]))
        if self._clock() - self._drawn_at >= self._min_interval_s:
            self._draw()

    def end(self) -> None:
        self._draw()
        self._write("\n")

    def _draw(self) -> None:
        text = self._tokenizer.decode(self._tokens, skip_special_tokens=True)
        line = (self._prompt + text).replace("\r", " ").replace("\n", " ")  # one line, whatever the model writes
        self._write("\r" + line.ljust(self._width))  # blanks over a longer line drawn before
        self._width = len(line)
        self._drawn_at = self._clock()

    def _write(self, text: str) -> None:
        out = self._out or sys.stdout
        out.write(text)
        out.flush()
