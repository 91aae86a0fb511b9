"""fsdp2nb.TrainerCallback under a real Trainer on 2 gloo ranks: a save asked for on one rank only
is taken by Trainer at the same step on both, and Trainer's logs reach fsdp2nb.log."""

import os

import pytest

from tests.support.gloo_harness import run_ranks

pytest.importorskip("transformers")


def _train_with_a_save_asked_on_rank_1(out_dir: str) -> tuple[list[str], list[int]]:
    import torch
    from transformers import Trainer, TrainingArguments

    import fsdp2nb
    from fsdp2nb.checkpoint.requests import post_save_request
    from fsdp2nb.examples.tiny_models import make_tiny_model
    from fsdp2nb.metrics import process_metrics

    model = make_tiny_model("llama")
    rows = torch.arange(3, 3 + 16).repeat(8, 1)
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(output_dir=out_dir, max_steps=3, per_device_train_batch_size=2, save_strategy="no",
                             report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[fsdp2nb.TrainerCallback()])
    if int(os.environ["RANK"]) == 1:
        post_save_request(1)  # as the rank's control thread does when Save is pressed
    trainer.train()
    return sorted(os.listdir(out_dir)), sorted({p.step for p in process_metrics().drain() if "loss" in p.values})


@pytest.mark.timeout(300)
def test_a_save_asked_on_one_rank_is_taken_by_trainer_at_one_step(tmp_path):
    results = run_ranks(_train_with_a_save_asked_on_rank_1, 2, str(tmp_path / "out"))
    # Agreed at the second step end (posted at the first, read at the next), and only there.
    assert results[0][0] == ["checkpoint-2"], results
    assert results[0][1] == results[1][1] == [1, 2, 3]


def _stop_on_rank_0_then_save_on_rank_1(out_dir: str) -> tuple[int, list[str]]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import fsdp2nb
    from fsdp2nb.checkpoint.requests import post_save_request, process_stops
    from fsdp2nb.examples.tiny_models import make_tiny_model

    class Ask(TrainerCallback):
        """Asks as the rank's control thread would, just before fsdp2nb's callback reads it."""

        def on_step_end(self, args, state, control, **kwargs):
            rank = int(os.environ["RANK"])
            if state.global_step == 1 and rank == 0:
                process_stops().post()
            if state.global_step == 2 and rank == 1:
                post_save_request(1)

    rows = torch.arange(3, 3 + 16).repeat(8, 1)
    data = [{"input_ids": row, "labels": row} for row in rows]
    args = TrainingArguments(output_dir=out_dir, max_steps=20, per_device_train_batch_size=2, save_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=make_tiny_model("llama"), args=args, train_dataset=data,
                      callbacks=[Ask(), fsdp2nb.TrainerCallback()])
    trainer.train()
    return trainer.state.global_step, sorted(os.listdir(out_dir))


@pytest.mark.timeout(300)
def test_a_stop_ends_training_a_step_later_and_its_last_step_agrees_at_once(tmp_path):
    """Stop asked at step 1 is read at step 2's end, the last step: a save asked during it is not
    posted for a step that never comes but agreed there, so checkpoint-2 is written."""
    results = run_ranks(_stop_on_rank_0_then_save_on_rank_1, 2, str(tmp_path / "out"))
    assert results[0] == results[1] == (2, ["checkpoint-2"]), results
