"""`fsdp2nb.generate` and `fsdp2nb.evaluate` in one process: shares, checks of bad input, the
streamed line, collation, and why a model stays sharded. The ranks' side is in
tests/kernel/test_generation.py."""

from __future__ import annotations

import io

import pytest
import torch

import fsdp2nb
from fsdp2nb.engine.evaluation import EvaluationInputError, collate_examples
from fsdp2nb.engine.generation import FirstPromptLine, GenerationInputError
from fsdp2nb.engine.inference import (
    InferenceInputError,
    _why_sharded,
    item_share,
    max_gathered_bytes_from,
    rank_share,
    working_ranks,
    working_threads,
)
from fsdp2nb.examples.tiny_models import make_tiny_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("llama").eval(), make_tiny_tokenizer()


def test_shares_are_contiguous_in_order_and_cover_every_item_once():
    assert [rank_share(5, rank, 2) for rank in range(2)] == [range(0, 3), range(3, 5)]
    assert [len(rank_share(1, rank, 4)) for rank in range(4)] == [1, 0, 0, 0]
    for num_items in range(12):
        shares = [rank_share(num_items, rank, 4) for rank in range(4)]
        assert [i for share in shares for i in share] == list(range(num_items))



def test_cpu_ranks_decode_one_per_batch_and_per_core_and_every_gpu_rank():
    """(host id, cores) per rank and the batches the prompts make; 0 cores is a GPU rank."""
    assert working_ranks([(7, 2), (7, 2), (9, 2), (9, 2)], 8) == (0, 1, 2, 3)
    assert working_ranks([(7, 2)] * 4, 8) == (0, 1)  # 4 ranks on 2 cores: one per core
    assert working_ranks([(7, 16)] * 4, 1) == (0,)  # one batch: one rank, on every core
    assert working_ranks([(7, 16)] * 4, 3) == (0, 1, 2)
    assert working_ranks([(0, 0)] * 4, 1) == (0, 1, 2, 3)
    assert working_ranks([(9, 1), (7, 1), (9, 1)], 5) == (0, 1)


def test_a_host_s_cores_are_split_over_its_decoding_ranks_and_the_others_keep_theirs():
    assert working_threads([(7, 2)] * 4, (0, 1)) == (1, 1, 0, 0)
    assert working_threads([(7, 16)] * 4, (0,)) == (16, 0, 0, 0)
    assert working_threads([(7, 16)] * 3 + [(9, 4)], (0, 1, 2, 3)) == (5, 5, 5, 4)
    assert working_threads([(0, 0)] * 2, (0, 1)) == (0, 0)  # GPU ranks: the device does the work


def test_items_go_to_the_working_ranks_in_rank_order():
    assert [item_share(5, rank, (0, 2)) for rank in range(4)] == [range(0, 3), range(0), range(3, 5), range(0)]
    assert [item_share(3, rank, (0,)) for rank in range(2)] == [range(0, 3), range(0)]

@pytest.mark.parametrize(("prompts", "kwargs", "message"), [
    ([], {"max_new_tokens": 4}, "no prompts"),
    ("hi", {}, "max_new_tokens is missing"),
    ("hi", {"max_new_tokens": 0}, "max_new_tokens=0 must be an int >= 1"),
    ("hi", {"max_new_tokens": 4, "synced_gpus": True}, "synced_gpus is chosen by fsdp2nb.generate"),
    ([1, 2], {"max_new_tokens": 4}, "prompts must be a string or a list of strings"),
    ("hi", {"max_new_tokens": 4, "batch_size": 0}, r"batch_size=0 must be an int >= 1 \(the most prompts"),
    ("hi", {"max_new_tokens": 4, "batch_size": 2.5}, "batch_size=2.5 must be an int >= 1"),
])
def test_bad_input_is_one_line_before_anything_runs(tiny, prompts, kwargs, message):
    model, tokenizer = tiny
    with pytest.raises(GenerationInputError, match=message) as raised:
        fsdp2nb.generate(model, tokenizer, prompts, **kwargs)
    assert "\n" not in str(raised.value) and isinstance(raised.value, ValueError)
    assert not model.training


def test_a_tokenizer_without_a_pad_token_is_refused_saying_what_to_set(tiny):
    model, _ = tiny
    tokenizer = make_tiny_tokenizer()
    tokenizer.pad_token = None
    with pytest.raises(GenerationInputError, match=r"no pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        fsdp2nb.generate(model, tokenizer, ["a", "b"], max_new_tokens=2)


def test_one_process_generates_as_the_model_does_and_a_string_gives_a_string(tiny):
    model, tokenizer = tiny
    prompts = ["abc", "a longer prompt"]
    completions = fsdp2nb.generate(model, tokenizer, prompts, max_new_tokens=5, do_sample=False)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert completions == tokenizer.batch_decode(expected[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert fsdp2nb.generate(model, tokenizer, "abc", max_new_tokens=5, do_sample=False) == completions[0]


def test_the_streamed_line_is_redrawn_in_place_at_most_so_often_and_ended_once():
    tokenizer, out, now = make_tiny_tokenizer(), io.StringIO(), [0.0]
    line = FirstPromptLine(tokenizer, "Say", out=out, min_interval_s=1.0, clock=lambda: now[0])
    line.put(torch.tensor([[5, 6], [7, 8]]))  # the prompts: not drawn
    ids = tokenizer.convert_tokens_to_ids(list("hello"))
    for step, token in enumerate(ids):
        now[0] = step * 0.4
        line.put(torch.tensor([token, 0]))  # row 0 is the first prompt's
    line.end()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.startswith("\r")
    assert text.count("\r") == 3  # at 0.0 s, 1.2 s, and at the end
    assert text.rsplit("\r", 1)[1].replace(" ", "") == "Sayhello\n"


def test_collation_stacks_examples_and_asks_for_a_collate_fn_when_lengths_differ():
    batch = collate_examples([[1, 2, 3], [4, 5, 6]])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6]]
    batch = collate_examples([{"input_ids": [1, 2], "labels": [-100, 2]}] * 2)
    assert set(batch) == {"input_ids", "labels"} and batch["labels"].shape == (2, 2)
    with pytest.raises(EvaluationInputError, match="collate_fn that pads them"):
        collate_examples([[1, 2], [1, 2, 3]])


def test_evaluate_in_one_process_weights_the_mean_by_tokens(tiny):
    model, _ = tiny
    examples = [torch.arange(3, 3 + length) for length in (4, 9, 9, 4)]
    result = fsdp2nb.evaluate(model, examples, batch_size=1)
    with torch.no_grad():
        sums = [torch.nn.functional.cross_entropy(model(input_ids=e[None]).logits[0, :-1], e[1:], reduction="sum")
                for e in examples]
    assert result.num_tokens == 3 + 8 + 8 + 3 and result.num_examples == 4
    assert result.loss == pytest.approx(float(sum(sums)) / 22, rel=1e-6)
    assert not model.training


@pytest.mark.parametrize(("dataset", "kwargs", "message"), [
    ([], {}, "the dataset is empty"),
    (iter([1]), {}, "dataset must have a length"),
    ([[1, 2]], {"batch_size": 0}, "batch_size=0 must be an int >= 1"),
    ([[1, 2]], {"step": "3"}, "step='3' must be an int"),
])
def test_evaluate_refuses_bad_input_in_one_line(tiny, dataset, kwargs, message):
    with pytest.raises(EvaluationInputError, match=message):
        fsdp2nb.evaluate(tiny[0], dataset, **kwargs)


def test_why_a_model_stays_sharded_gives_the_figures(monkeypatch):
    assert _why_sharded(1000, (10_000, 20_000), None) == ""
    assert _why_sharded(1000, (10_000, 20_000), 999) == (
        "the gathered model needs 1000 B per rank, over the limit of 999 B (max_gathered_bytes / "
        "FSDP2NB_MAX_GATHERED_BYTES)")
    assert _why_sharded(9 * 2**30, (16 * 2**30, 10 * 2**30), None) == (
        "the gathered model needs 9 GiB per rank, more than 80% of the 10 GiB rank 1 has free")
    monkeypatch.setenv("FSDP2NB_MAX_GATHERED_BYTES", "2e9")
    assert max_gathered_bytes_from(None) == 2_000_000_000 and max_gathered_bytes_from(5) == 5
    monkeypatch.setenv("FSDP2NB_MAX_GATHERED_BYTES", "lots")
    with pytest.raises(InferenceInputError, match="FSDP2NB_MAX_GATHERED_BYTES='lots' must be a number of bytes"):
        max_gathered_bytes_from(None)
