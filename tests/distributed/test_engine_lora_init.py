"""LoRA on a meta-built model: every peft initialisation choice, and modules trained whole."""

from __future__ import annotations

import torch

from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.gloo_harness import run_ranks


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _load_with_lora(path: str, **lora_options) -> dict[str, torch.Tensor]:
    from peft import LoraConfig

    from fsdp2nb.engine import FSDP2Engine, load_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **lora_options)
    model, _ = load_model(path, lora=config, engine=FSDP2Engine(mixed_precision="fp32"))
    return _full(model)


def test_adapters_left_to_their_layers_default_start_sane_and_alike(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "model", "llama")
    per_rank = run_ranks(_load_with_lora, 2, str(path), init_lora_weights=False)
    adapters = {n: t for n, t in per_rank[0].items() if "lora_" in n}
    assert adapters
    for name, tensor in adapters.items():
        # nn.Linear's own start: uniform within 1/sqrt(fan_in), not what to_empty left in memory
        bound = tensor.shape[1] ** -0.5
        assert tensor.abs().max() <= bound and tensor.abs().max() > 0, name
        assert torch.equal(tensor, per_rank[1][name]), name


def test_a_module_trained_whole_loads_both_of_its_copies(tmp_path):
    from safetensors.torch import load_file

    path = save_tiny_checkpoint(tmp_path / "model", "qwen2")
    head = next(v for k, v in load_file(next(path.glob("*.safetensors"))).items() if k == "lm_head.weight")
    full = run_ranks(_load_with_lora, 2, str(path), modules_to_save=["lm_head"])[0]
    copies = [n for n in full if n.startswith("base_model.model.lm_head.")]
    assert sorted(copies) == ["base_model.model.lm_head.modules_to_save.default.weight",
                              "base_model.model.lm_head.original_module.weight"]
    assert all(torch.equal(full[name], head) for name in copies)
