"""A `load_model` model (full and LoRA) under Trainer via fsdp2nb.trainer_for, on 2 gloo ranks: it
trains sharded, its checkpoints resume to the same losses, and save_model loads with from_pretrained."""

from __future__ import annotations

import os

import pytest
import torch

from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.gloo_harness import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")

NUM_STEPS = 4


def _data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 131, (16, 12), generator=generator)
    return [{"input_ids": row, "labels": row} for row in rows]


def _load(path: str, lora: bool):
    from peft import LoraConfig

    from fsdp2nb.engine import FSDP2Engine, load_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian") \
        if lora else None
    model, _ = load_model(path, lora=config, engine=FSDP2Engine(mixed_precision="fp32"))
    return model


def _train(model, out_dir: str, resume: str | None = None) -> tuple[object, dict[int, float]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import fsdp2nb

    losses: dict[int, float] = {}

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    args = TrainingArguments(output_dir=out_dir, max_steps=NUM_STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_strategy="steps", save_steps=2, report_to="none",
                             use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0)
    trainer = fsdp2nb.trainer_for(Trainer)(model=model, args=args, train_dataset=_data(),
                                           callbacks=[Losses(), fsdp2nb.TrainerCallback()])
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses


def _full_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}


def _train_resume_and_save(path: str, root: str, lora: bool) -> dict:
    from torch.distributed.tensor import DTensor

    model = _load(path, lora)
    trainer, losses = _train(model, f"{root}/run")
    wrapped = type(trainer.model_wrapped).__name__
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    trainer.save_model(f"{root}/final")
    trained = _full_params(model)
    _, resumed_losses = _train(_load(path, lora), f"{root}/run", resume=f"{root}/run/checkpoint-2")
    return dict(losses=losses, resumed_losses=resumed_losses, wrapped=wrapped, sharded=sharded,
                trainer_model_is_model=trainer.model is model, trained=trained,
                checkpoint=sorted(os.listdir(f"{root}/run/checkpoint-2")))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trainer_trains_sharded_resumes_and_saves(tmp_path, lora):
    from transformers import AutoModelForCausalLM

    path = save_tiny_checkpoint(tmp_path / "model", "llama")
    results = run_ranks(_train_resume_and_save, 2, str(path), str(tmp_path), lora)
    first = results[0]
    assert first["sharded"] and first["trainer_model_is_model"], first["wrapped"]
    assert first["wrapped"] != "DistributedDataParallel"
    assert "fsdp2nb_dcp" in first["checkpoint"] and "trainer_state.json" in first["checkpoint"]
    assert sorted(first["losses"]) == list(range(1, NUM_STEPS + 1))
    assert first["losses"][1] != first["losses"][NUM_STEPS]  # it trained
    # resumed at step 2: steps 3 and 4 repeat the uninterrupted run's losses
    assert sorted(first["resumed_losses"]) == [3, 4]
    for step in (3, 4):
        assert first["resumed_losses"][step] == pytest.approx(first["losses"][step], rel=1e-5), step

    final = tmp_path / "final"
    base = AutoModelForCausalLM.from_pretrained(path if lora else final, dtype=torch.float32)
    if lora:
        from peft import PeftModel

        base = PeftModel.from_pretrained(base, final)
    loaded = dict(base.named_parameters())
    for name, tensor in first["trained"].items():
        if lora and "lora_" not in name:
            continue
        assert torch.allclose(loaded[name], tensor, atol=1e-6), name


def _plain_trainer_error(path: str, out_dir: str) -> str:
    from transformers import Trainer, TrainingArguments

    import fsdp2nb

    args = TrainingArguments(output_dir=out_dir, max_steps=1, report_to="none", use_cpu=True)
    try:
        Trainer(model=_load(path, lora=False), args=args, train_dataset=_data(), callbacks=[fsdp2nb.TrainerCallback()])
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(200)
def test_a_plain_trainer_with_the_callback_says_to_use_trainer_for(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "model", "llama")
    messages = run_ranks(_plain_trainer_error, 2, str(path), str(tmp_path / "out"))
    assert all("fsdp2nb.trainer_for(Trainer)" in m and "\n" not in m for m in messages), messages


def _sft_lora(path: str, root: str) -> dict:
    from datasets import Dataset
    from torch.distributed.tensor import DTensor
    from trl import SFTConfig, SFTTrainer

    import fsdp2nb
    from fsdp2nb.engine.loader import load_processor

    tokenizer = load_processor(path)
    texts = Dataset.from_dict({"text": [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(32)]})
    losses: list[dict[int, float]] = []
    for resume in (None, f"{root}/sft/checkpoint-2"):
        model = _load(path, lora=True)
        args = SFTConfig(output_dir=f"{root}/sft", max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                         save_strategy="steps", save_steps=2, report_to="none", use_cpu=True, logging_steps=1,
                         disable_tqdm=True, max_length=32, seed=0)
        trainer = fsdp2nb.trainer_for(SFTTrainer)(model=model, args=args, train_dataset=texts,
                                                  processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)
        losses.append({e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e})
    trainer.save_model(f"{root}/sft-final")
    return dict(losses=losses, sharded=all(isinstance(p, DTensor) for p in model.parameters()),
                adapter={n: p.full_tensor() for n, p in model.named_parameters() if "lora_" in n})


@pytest.mark.timeout(400)
def test_sft_trainer_with_lora_trains_sharded_resumes_and_saves_an_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = save_tiny_checkpoint(tmp_path / "model", "llama")
    first = run_ranks(_sft_lora, 2, str(path), str(tmp_path))[0]
    uninterrupted, resumed = first["losses"]
    # the resumed run's log_history starts with the checkpoint's (steps 1, 2), then logs step 3 anew
    assert first["sharded"] and sorted(uninterrupted) == sorted(resumed) == [1, 2, 3]
    assert resumed[3] == pytest.approx(uninterrupted[3], rel=1e-5)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), tmp_path / "sft-final")
    params = dict(loaded.named_parameters())
    assert first["adapter"] and all(torch.allclose(params[n], t, atol=1e-6) for n, t in first["adapter"].items())


def _losses_with_accumulation(path: str, out_dir: str) -> list[list[float]]:
    from transformers import Trainer, TrainingArguments

    import fsdp2nb

    runs = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        args = TrainingArguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=batch_size,
                                 gradient_accumulation_steps=accumulation, learning_rate=1e-2, save_strategy="no",
                                 report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0)
        trainer = fsdp2nb.trainer_for(Trainer)(model=_load(path, lora=False), args=args, train_dataset=_data())
        trainer.train()
        runs.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    return runs


@pytest.mark.timeout(300)
def test_gradient_accumulation_matches_the_bigger_batch(tmp_path):
    path = save_tiny_checkpoint(tmp_path / "model", "llama")
    whole, accumulated = run_ranks(_losses_with_accumulation, 2, str(path), str(tmp_path / "out"))[0]
    assert len(whole) == 3 and accumulated == pytest.approx(whole, rel=1e-4)
