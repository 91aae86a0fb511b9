"""A Hugging Face Trainer in `%%fsdp2` cells of a real ipykernel: a plain Trainer given a
`load_model` model says in one line what to use instead."""

from __future__ import annotations

import re

import pytest

from tests.support.dashboard_comms import Iopub
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

pytest.importorskip("transformers")

SETUP = """%%fsdp2
import time, torch, transformers, fsdp2nb
rows = torch.randint(3, 131, (64, 12), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in rows]

def load():
    model, _ = fsdp2nb.load_model(model_dir, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
    return model

def arguments(**overrides):
    settings = dict(output_dir=out_dir, per_device_train_batch_size=2, report_to="none", use_cpu=True,
                    disable_tqdm=True, logging_steps=1, save_strategy="no")
    return transformers.TrainingArguments(**{**settings, **overrides})
"""

@pytest.fixture(scope="module")
def dash(tmp_path_factory):
    from fsdp2nb.examples.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf-trainer")
    model_dir = save_tiny_checkpoint(root / "model", "llama")
    kernel = Kernel(env=WITHOUT_GPUS)
    iopub = Iopub(kernel)
    iopub.run(f"%load_ext fsdp2nb\nmodel_dir = {str(model_dir)!r}\nout_dir = {str(root / 'out')!r}")
    iopub.run("%fsdp2 start --cpu 2")
    iopub.run("%fsdp2 push model_dir out_dir")
    setup = iopub.run(SETUP)
    assert not [m for m in setup if m["msg_type"] == "error"], setup
    iopub.root = root
    yield iopub
    kernel.stop()


def _stream(messages: list[dict]) -> str:
    return "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")


def _error_lines(messages: list[dict]) -> list[str]:
    errors = [m["content"]["traceback"] for m in messages if m["msg_type"] == "error"]
    return [re.sub(r"\x1b\[[0-9;]*m", "", line) for error in errors for line in error]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("with_callback", [False, True], ids=["plain", "with-callback"])
def test_a_plain_trainer_given_a_load_model_model_says_in_one_line_to_use_trainer_for(dash, with_callback):
    callbacks = "[fsdp2nb.TrainerCallback()]" if with_callback else "None"
    code = (f"%%fsdp2\ntrainer = transformers.Trainer(model=load(), args=arguments(max_steps=2), train_dataset=data, "
            f"callbacks={callbacks})\ntrainer.train()\nprint('trained')")
    messages = dash.run(code)
    lines = _error_lines(messages)
    assert "trained" not in _stream(messages)
    # Without the callback DDP's constructor fails on every rank; with it, Trainer's construction does.
    assert len(lines) == 1 and lines[0].startswith("[all] ranks 0, 1 raised"), lines
    assert "fsdp2nb.trainer_for(Trainer)" in lines[0] and "DTensor" not in lines[0], lines
