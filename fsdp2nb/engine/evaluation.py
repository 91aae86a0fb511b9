"""`fsdp2nb.evaluate`: mean loss and perplexity of a causal LM over a dataset spread over the ranks.

Each working rank (every GPU rank; on CPU, one per batch and per core, as for generation) takes
its contiguous share of the examples (each example once; the first ranks take one more where the
count does not divide) and runs it in batches with the model in eval mode and without gradients,
on the whole model gathered once (`inference.as_planned`) or, where that does not fit, sharded:
then every rank runs as many forward passes as the rank with the most batches, the others a
one-token pass whose result is dropped. The loss is summed per predicted token on each
rank and the sums added over the ranks, so the mean is weighted by tokens and equals one process
going through the whole dataset, however the batches fall.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp2nb import metrics, progress
from fsdp2nb.collectives import gathered_if_all_succeeded, get_rank, get_world_size
from fsdp2nb.engine.inference import (
    InferenceInputError,
    as_planned,
    evaluating,
    item_share,
    max_gathered_bytes_from,
    model_device,
    plan_gathering,
)

IGNORE_INDEX = -100
"""Label of a position that is not scored (Hugging Face's convention): padding, a prompt."""


class EvaluationInputError(InferenceInputError):
    """A dataset or setting that `fsdp2nb.evaluate` cannot use (one line says which)."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What `fsdp2nb.evaluate` measured, the same on every rank."""

    loss: float
    """Mean cross-entropy per predicted token over the whole dataset (nats)."""
    perplexity: float
    """exp(loss)."""
    num_tokens: int
    """Tokens scored: every label but the first of each example and those set to -100."""
    num_examples: int


def evaluate(model: nn.Module, dataset: Sequence, *, batch_size: int = 8,
             collate_fn: Callable[[list], Mapping[str, Any]] | None = None, step: int | None = None,
             max_gathered_bytes: int | None = None) -> Evaluation:
    """Mean loss and perplexity of `model` over `dataset`, each example on one rank; collective.

    Call it on every rank with the same dataset (a `%%fsdp2` cell). An example is a dict with
    `input_ids` (and `attention_mask`, `labels` where it has them; labels default to the inputs,
    with padding left out) or a sequence of token ids; examples of one batch must be of one length
    unless `collate_fn` pads them (e.g. `transformers.DataCollatorWithPadding(tokenizer)`). With
    `step`, the result goes to the dashboard's curves as `eval_loss` and `eval_perplexity`.
    Example: `fsdp2nb.evaluate(model, val_examples, batch_size=8, step=step)`.
    """
    num_examples = _length(dataset)
    _check_settings(batch_size, step)
    limit = max_gathered_bytes_from(max_gathered_bytes)
    collate = collate_fn or collate_examples
    with evaluating(model):
        plan, facts = plan_gathering(model, limit, local_facts=(num_examples,),
                                     num_batches=-(-num_examples // batch_size))
        _require_same_dataset([count for (count,) in facts])
        share = item_share(num_examples, get_rank(), plan.working_ranks)
        batches = [share[start:start + batch_size] for start in range(0, len(share), batch_size)]
        num_steps = max(math.ceil(len(item_share(num_examples, rank, plan.working_ranks)) / batch_size)
                        for rank in range(get_world_size()))
        task = progress.start_task("evaluate", "evaluating", total_items=num_steps)
        sums, error = [0.0, 0], None
        try:
            with as_planned(model, plan, "fsdp2nb.evaluate"):
                sums, error = _run(model, dataset, batches, collate, num_steps if plan.lockstep else None, task)
        except Exception as exc:  # every rank hears of it below, rather than waiting in the gather
            error = exc
        task.finish(error)
    result = _combined(gathered_if_all_succeeded(sums, error, "fsdp2nb.evaluate"), num_examples)
    if step is not None:
        metrics.log(step, eval_loss=result.loss, eval_perplexity=result.perplexity)
    return result


def _length(dataset: Sequence) -> int:
    try:
        num_examples = len(dataset)
    except TypeError:
        raise EvaluationInputError(f"dataset must have a length and be indexable (a list, a datasets.Dataset, a "
                                   f"torch Dataset), not {type(dataset).__name__}") from None
    if num_examples == 0:
        raise EvaluationInputError("the dataset is empty: pass at least one example")
    return num_examples


def _check_settings(batch_size: int, step: int | None) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise EvaluationInputError(f"batch_size={batch_size!r} must be an int >= 1")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise EvaluationInputError(f"step={step!r} must be an int (the training step to log at) or None")


def _require_same_dataset(counts: list[int]) -> None:
    if any(count != counts[0] for count in counts):
        listed = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
        raise EvaluationInputError(f"the ranks were given datasets of different lengths ({listed} examples): pass "
                                   "the same dataset on every rank; each rank evaluates its share")


def _run(model: nn.Module, dataset: Sequence, batches: list[range], collate: Callable, lockstep_steps: int | None,
         task: progress.AnyTask) -> tuple[list, BaseException | None]:
    """[summed loss, tokens] over this rank's batches, and the error that stopped them.

    Sharded (`lockstep_steps` set), a rank runs that many forward passes whatever happens: past its
    own batches, or once one failed, one-token passes, which are the collectives the other ranks
    wait in. The bar is advanced to `task`'s total either way: it follows the slowest rank."""
    device = model_device(model)
    loss_sum, num_tokens, error = 0.0, 0, None
    for index in range(lockstep_steps or len(batches)):
        if index < len(batches) and error is None:
            try:
                batch_loss, batch_tokens = _batch_loss(model, collate([dataset[i] for i in batches[index]]), device)
                loss_sum, num_tokens = loss_sum + batch_loss, num_tokens + batch_tokens
            except Exception as exc:
                error = exc
        elif lockstep_steps is None:
            break
        else:
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
        task.advance(num_items=1)
    if isinstance(task, progress.Task):
        task.advance(num_items=task.total_items - task.done_items)  # a short share is done before the others
    return [loss_sum, num_tokens], error


def _batch_loss(model: nn.Module, batch: Mapping[str, Any], device: torch.device) -> tuple[float, int]:
    """Summed cross-entropy of every scored next token of `batch`, and how many were scored."""
    inputs = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in batch.items()}
    if "input_ids" not in inputs:
        raise EvaluationInputError(f"a batch has no input_ids (it has {sorted(inputs)}): pass examples with "
                                   "input_ids, or a collate_fn that makes them")
    labels = inputs.pop("labels", None)
    if labels is None:
        mask = inputs.get("attention_mask")
        labels = inputs["input_ids"] if mask is None else inputs["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
    logits = model(**inputs).logits  # (batch, length, vocab)
    targets = labels[:, 1:]  # position t predicts token t + 1
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return float(loss), int((targets != IGNORE_INDEX).sum())


def collate_examples(examples: list) -> dict[str, torch.Tensor]:
    """Stack examples of one length into a batch: dicts key by key, bare token sequences as input_ids."""
    if not isinstance(examples[0], Mapping):
        examples = [{"input_ids": example} for example in examples]
    batch = {}
    for name in examples[0]:
        values = [torch.as_tensor(example[name]) for example in examples]
        if any(value.shape != values[0].shape for value in values):
            shapes = sorted({tuple(value.shape) for value in values})
            raise EvaluationInputError(f"the examples of a batch differ in {name} shape ({shapes}): pass a "
                                       "collate_fn that pads them, e.g. transformers.DataCollatorWithPadding(tokenizer)")
        batch[name] = torch.stack(values)
    return batch


def _combined(sums: list[list], num_examples: int) -> Evaluation:
    """The token-weighted mean over every rank's sums, added in rank order (the same on every rank)."""
    loss_sum = math.fsum(entry[0] for entry in sums)
    num_tokens = sum(entry[1] for entry in sums)
    if num_tokens == 0:
        raise EvaluationInputError("no token was scored: every label is -100 or every example has one token")
    loss = loss_sum / num_tokens
    return Evaluation(loss=loss, perplexity=math.exp(loss), num_tokens=num_tokens, num_examples=num_examples)
