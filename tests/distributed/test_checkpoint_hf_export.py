"""export_hf_model on 2 ranks: from_pretrained (and peft) load what it wrote, with equal tensors."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp2nb.checkpoint import export_hf_model
from fsdp2nb.testing.tiny_models import make_tiny_model, make_tiny_tokenizer
from tests.distributed.harness import run_ranks
from tests.distributed.test_checkpoint_helpers import assert_same, build, full_model_state, train_step


def _export_all(root: str) -> dict:
    import torch.distributed as dist

    torch.manual_seed(dist.get_rank())
    results = {}
    for tie in (False, True):
        model, optimizer, scheduler = build(seed=0, tie_word_embeddings=tie)
        train_step(model, optimizer, scheduler)
        export_hf_model(model, f"{root}/plain-tied{int(tie)}", dtype=torch.bfloat16,
                        processor=make_tiny_tokenizer(), max_shard_bytes=20_000)
        results[f"plain-tied{int(tie)}"] = full_model_state(model)
    model, optimizer, scheduler = build(seed=0, lora=True)
    train_step(model, optimizer, scheduler)  # moves lora_B off zero, so the merge is not a no-op
    export_hf_model(model, f"{root}/lora", merge_lora=True)
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

    from tests.distributed.test_checkpoint_helpers import make_lora

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
