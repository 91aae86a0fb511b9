"""Ten training steps on 2 gloo ranks match one process training on the same global batch.

Each rank trains on its half of a fixed batch of equal-length sequences; FSDP averages the
gradients over ranks, which equals the single-process gradient of the mean loss over the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.gloo_harness import run_ranks

NUM_STEPS = 10
WORLD_SIZE = 2
MAX_NORM = 1.0
LORA_SEED = 0
# (name, mixed_precision, lora, activation_checkpointing)
RUNS = (
    ("full_fp32", "fp32", False, False),
    ("lora_fp32", "fp32", True, False),
    ("full_fp32_ac", "fp32", False, True),
    ("full_bf16", "bf16", False, False),
    ("lora_bf16", "bf16", True, False),
)


def _batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, 131, (4, 12), generator=generator)


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


def _trainable_full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def _train_sharded(path: str, mixed_precision: str, lora: bool, activation_checkpointing: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    import fsdp2nb
    from fsdp2nb.engine import FSDP2Engine, load_model

    engine = FSDP2Engine(mixed_precision=mixed_precision)
    # The adapters' random start decides how far float rounding (sharded sums versus one batch)
    # drifts in ten steps: about 1e-6 relative for most draws, past the 1e-5 compared below for
    # a rare one. A fixed draw makes the comparison the same on every run.
    torch.manual_seed(LORA_SEED)  # load_model draws the adapters' seed on rank 0 (lora.shared_seed)
    model, _ = load_model(path, lora=_lora_config() if lora else None, engine=engine,
                          activation_checkpointing=activation_checkpointing)
    initial = _trainable_full_state(model) if lora else {}
    optimizer = _optimizer(model)
    rank = dist.get_rank()
    local = _batch()[2 * rank: 2 * rank + 2]
    losses, norms = [], []
    for _ in range(NUM_STEPS):
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        norms.append(fsdp2nb.clip_grad_norm_(model, MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / dist.get_world_size())
    lora_modules = [m for n, m in model.named_modules() if "lora_" in n.rsplit(".", 1)[-1]]
    return dict(
        losses=losses, norms=norms, initial=initial,
        dtypes={n: (p.dtype, p.requires_grad) for n, p in model.named_parameters()},
        lora_units=sum(isinstance(m, FSDPModule) for m in lora_modules),
    )


def _train_all(path: str) -> dict:
    return {name: _train_sharded(path, *settings) for name, *settings in RUNS}


def _train_single(path, initial: dict[str, torch.Tensor], lora: bool) -> tuple[list[float], list[float]]:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        model = get_peft_model(model, _lora_config())
        missing = model.load_state_dict(initial, strict=False).unexpected_keys
        assert not missing
    optimizer = _optimizer(model)
    batch = _batch()
    losses, norms = [], []
    for _ in range(NUM_STEPS):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple:
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama")
    return path, run_ranks(_train_all, WORLD_SIZE, str(path))


@pytest.mark.parametrize("name", ["full_fp32", "lora_fp32", "full_fp32_ac"])
def test_fp32_losses_and_norms_match_single_process(trained, name):
    path, per_rank = trained
    result = per_rank[0][name]
    losses, norms = _train_single(path, result["initial"], lora=name.startswith("lora"))
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    assert result["norms"] == pytest.approx(norms, rel=1e-5)
    assert per_rank[1][name]["norms"] == result["norms"]  # every rank sees the global norm


@pytest.mark.parametrize("name", ["full_bf16", "lora_bf16"])
def test_bf16_training_lowers_the_loss_and_tracks_fp32(trained, name):
    results = trained[1][0]
    losses = results[name]["losses"]
    assert losses[-1] < losses[0] - 0.05
    # bf16 compute with fp32 storage and reduction stays close to the fp32 run.
    assert losses == pytest.approx(results[name.replace("bf16", "fp32")]["losses"], rel=0.02, abs=0.02)


def test_lora_adapters_stay_fp32_inside_block_units(trained):
    result = trained[1][0]["lora_bf16"]
    adapters = {n: d for n, d in result["dtypes"].items() if "lora_" in n}
    assert adapters and all(d == (torch.float32, True) for d in adapters.values())
    frozen = [d for n, d in result["dtypes"].items() if "lora_" not in n]
    assert all(d == (torch.bfloat16, False) for d in frozen)
    assert result["lora_units"] == 0  # no adapter got an FSDP unit of its own


def test_every_lora_run_starts_from_the_same_fixed_draw(trained):
    # The fp32 comparison above holds for this draw; unseeded, it failed one run in five here.
    fp32, bf16 = (trained[1][0][name]["initial"] for name in ("lora_fp32", "lora_bf16"))
    assert fp32.keys() == bf16.keys() and fp32
    assert all(torch.equal(fp32[name], bf16[name]) for name in fp32)
