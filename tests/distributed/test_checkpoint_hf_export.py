"""export_hf on 2 ranks: from_pretrained (and peft) load what it wrote, with equal tensors."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp2nb import export_hf
from fsdp2nb.examples.tiny_models import make_tiny_model, make_tiny_tokenizer
from tests.support.checkpoint_helpers import assert_same, build, full_model_state, train_step
from tests.support.gloo_harness import run_ranks


def _export_all(root: str) -> dict:
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    results = {}
    for tie in (False, True):
        model, optimizer, scheduler = build(seed=0, tie_word_embeddings=tie)
        train_step(model, optimizer, scheduler)
        export_hf(model, f"{root}/plain-tied{int(tie)}", dtype=torch.bfloat16,
                        processor=make_tiny_tokenizer(), max_shard_bytes=20_000)
        results[f"plain-tied{int(tie)}"] = full_model_state(model)
    model, optimizer, scheduler = build(seed=0, lora=True)
    train_step(model, optimizer, scheduler)  # moves lora_B off zero, so the merge is not a no-op
    export_hf(model, f"{root}/lora", merge_lora=True)
    results["lora"] = full_model_state(model)
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    return root, run_ranks(_export_all, 2, str(root))[0]


@pytest.mark.parametrize("tie", [False, True])
def test_plain_export_loads_with_from_pretrained(exported, tie):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, states = exported
    out = root / f"plain-tied{int(tie)}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several files, written by both ranks
    assert ("lm_head.weight" in index["weight_map"]) is not tie
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and loaded.config.tie_word_embeddings is tie
    expected = {k: v.to(torch.bfloat16) for k, v in states[f"plain-tied{int(tie)}"].items()}
    assert_same({k: v for k, v in loaded.state_dict().items()}, expected)
    assert AutoTokenizer.from_pretrained(out).vocab_size > 0


def test_lora_adapter_loads_with_peft_and_merged_model_matches(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.support.checkpoint_helpers import make_lora

    root, states = exported
    trained = states["lora"]
    adapter = PeftModel.from_pretrained(make_tiny_model("llama", seed=0), root / "lora")
    lora_keys = [k for k in trained if "lora_" in k]
    assert lora_keys
    adapter_state = adapter.state_dict()
    for key in lora_keys:
        torch.testing.assert_close(adapter_state[key], trained[key], rtol=0, atol=0)

    reference = make_lora(make_tiny_model("llama", seed=0))
    reference.load_state_dict(trained)
    expected = reference.merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(root / "lora" / "merged").state_dict()
    assert merged.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(merged[key], expected[key], rtol=1e-6, atol=1e-6, msg=key)


class _FailingProcessor:
    def save_pretrained(self, directory) -> None:
        raise OSError("disk full")


def _export_failing_on_one_rank(root: str) -> dict[str, str]:
    """Exports that fail on one rank only: every rank must raise, none may hang in a collective."""
    import torch.distributed as dist

    from fsdp2nb.checkpoint import hf_export

    model, optimizer, scheduler = build(seed=0)
    out = f"{root}/export"
    export_hf(model, out, max_shard_bytes=20_000)
    seen = {}
    try:  # a step only rank 0 runs
        export_hf(model, out, processor=_FailingProcessor() if dist.get_rank() == 0 else None)
    except Exception as error:
        seen["rank0_step"] = str(error)
    real_flush = hf_export._flush

    def full_disk_on_rank1(tensors, path):
        if dist.get_rank() == 1:
            raise OSError("no space left on rank 1")
        return real_flush(tensors, path)

    hf_export._flush = full_disk_on_rank1
    try:  # a write on one rank while the others gather
        export_hf(model, out, max_shard_bytes=20_000)
    except Exception as error:
        seen["rank1_write"] = str(error)
    finally:
        hf_export._flush = real_flush
    return seen


def test_a_failure_on_one_rank_fails_the_export_on_every_rank(tmp_path):
    from transformers import AutoModelForCausalLM

    seen = run_ranks(_export_failing_on_one_rank, 2, str(tmp_path))
    assert "disk full" in seen[0]["rank0_step"] and "failed on rank 0" in seen[1]["rank0_step"]
    assert "failed on rank 1" in seen[0]["rank1_write"] and "no space left" in seen[1]["rank1_write"]
    AutoModelForCausalLM.from_pretrained(tmp_path / "export")  # the first export is still there
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
