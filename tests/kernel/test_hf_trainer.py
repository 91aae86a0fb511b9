"""A Hugging Face Trainer in `%%fsdp2` cells of a real ipykernel, driven from the dashboard as
JupyterLab drives it: Save makes Trainer write a `checkpoint-N` (listed in the panel), Stop ends
training at one step on every rank; a plain Trainer given a `load_model` model says in one line
what to use instead."""

from __future__ import annotations

import re

import pytest

from tests.support.dashboard_comms import Iopub, click, create_subshell
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

PACED_TRAINING = """%%fsdp2
class Pace(transformers.TrainerCallback):
    \"\"\"Steps long enough for a click to land between them; says when the first one is done.\"\"\"
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and rank == 0:
            print("first step done", flush=True)
        time.sleep(0.1)

trainer = fsdp2nb.trainer_for(transformers.Trainer)(model=load(), args=arguments(max_steps=MAX_STEPS),
                                                    train_dataset=data, callbacks=[Pace(), fsdp2nb.TrainerCallback()])
trainer.train()
print("stopped at step", trainer.state.global_step)
"""
MAX_STEPS = 400


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
    # DDP's constructor fails inside a collective, so the groups are re-formed: said in a note line.
    lines = [line for line in lines if "re-formed in place" not in line]
    assert len(lines) == 1 and lines[0].startswith("[all] ranks 0, 1 raised"), lines
    assert "fsdp2nb.trainer_for(Trainer)" in lines[0] and "DTensor" not in lines[0], lines


@pytest.mark.timeout(300)
def test_a_plain_trainer_after_trainer_for_trained_the_model_says_in_one_line_to_use_trainer_for(dash):
    trained = dash.run("%%fsdp2\nmodel = load()\nfsdp2nb.trainer_for(transformers.Trainer)(model=model, "
                       "args=arguments(max_steps=2), train_dataset=data).train()\n"
                       "before = {name: p.detach().clone() for name, p in model.named_parameters()}")
    assert not _error_lines(trained), _error_lines(trained)
    messages = dash.run("%%fsdp2\ntransformers.Trainer(model=model, args=arguments(max_steps=2), "
                        "train_dataset=data).train()\nprint('trained')")
    lines = [line for line in _error_lines(messages) if "re-formed in place" not in line]
    assert "trained" not in _stream(messages)
    assert len(lines) == 1 and lines[0].startswith("[all] ranks 0, 1 raised"), lines
    assert "fsdp2nb.trainer_for(Trainer)" in lines[0], lines
    # Nothing changed on the ranks: the model is the same module with the same weights, and trains on.
    after = dash.run("%%fsdp2\nprint('unchanged', type(model).__name__, all(torch.equal(p, before[name]) "
                     "for name, p in model.named_parameters()))\n"
                     "fsdp2nb.trainer_for(transformers.Trainer)(model=model, args=arguments(max_steps=1), "
                     "train_dataset=data).train()\nprint('trained on')")
    out = _stream(after)
    assert not _error_lines(after), _error_lines(after)
    assert "unchanged FSDPLlamaForCausalLM True" in out and "trained on" in out, out


@pytest.mark.timeout(300)
def test_save_and_stop_from_the_dashboard_drive_a_running_trainer(dash):
    save = dash.comm_of(_model_name="ButtonModel", description="Save now")
    stop = dash.comm_of(_model_name="ButtonModel", description="Stop")
    message_widget = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-message"])
    listing = dash.comm_of(_model_name="HTMLModel", _dom_classes=["fsdp2nb-trainer-checkpoints"])
    subshell = create_subshell(dash.kernel)
    out_dir = dash.root / "out"
    clicked: list[str] = []

    def on_message(message):
        if "save" not in clicked and message["msg_type"] == "stream" and "first step done" in message["content"]["text"]:
            clicked.append("save")
            click(dash.kernel, save, subshell)
        saved = list(out_dir.glob("checkpoint-*/trainer_state.json")) if out_dir.is_dir() else []
        if "save" in clicked and "stop" not in clicked and saved:  # Trainer wrote its state last
            clicked.append("stop")
            click(dash.kernel, stop, subshell)

    updates_before = len(dash.updates)
    messages = dash.run(PACED_TRAINING.replace("MAX_STEPS", str(MAX_STEPS)), on_message=on_message, timeout=240)
    outputs = _stream(messages)
    assert clicked == ["save", "stop"], outputs
    assert not _error_lines(messages), _error_lines(messages)  # Stop ended training, not the cell
    stopped_at = {label: int(step) for label, step in re.findall(r"^\[(all|\d)\] stopped at step (\d+)$", outputs,
                                                                re.MULTILINE)}
    assert set(stopped_at) in ({"all"}, {"0", "1"}), outputs  # both ranks ended training...
    (stopped,) = set(stopped_at.values())  # ...at the same step
    assert stopped < MAX_STEPS, outputs

    (checkpoint,) = sorted(p.name for p in out_dir.iterdir() if p.name.startswith("checkpoint-"))
    saved_step = int(checkpoint.removeprefix("checkpoint-"))
    assert 1 <= saved_step < stopped
    assert (out_dir / checkpoint / "fsdp2nb_dcp" / ".metadata").is_file()
    # The message said so, before the Stop click's message or after it (the save may end first).
    assert dash.was_sent(message_widget, "value", f"saved step {saved_step}", after=updates_before), \
        [state for cid, state in dash.updates[updates_before:] if cid == message_widget]
    shown = dash.wait_for(listing, "value", checkpoint)
    assert f"{checkpoint} · " in shown and "2 ranks" in shown and "incomplete" not in shown, shown


def test_the_text_dashboard_lists_the_trainers_checkpoints(dash):
    code = "import fsdp2nb\nprint(fsdp2nb._session.dashboard_link().text())"
    text = _stream(dash.run(code))
    assert f"Trainer checkpoints in {dash.root / 'out'}" in text, text
    assert re.search(r"^checkpoint-\d+ · .* · 2 ranks$", text, re.MULTILINE), text


@pytest.mark.timeout(300)
def test_a_rank_failing_inside_trainer_train_costs_no_state(dash):
    """Rank 1 raises at a step's end while rank 0 goes on into the next step's all-gathers: rank 0
    is released, the groups are re-formed in place, and the model trains on in the next cell."""
    trained = dash.run("%%fsdp2\nimport os\nmodel = load()\ntrainer = fsdp2nb.trainer_for(transformers.Trainer)("
                       "model=model, args=arguments(max_steps=2), train_dataset=data)\ntrainer.train()\n"
                       "kept, pid = 'kept', os.getpid()")
    assert not [m for m in trained if m["msg_type"] == "error"], _error_lines(trained)
    messages = dash.run(
        "%%fsdp2\nclass Fail(transformers.TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        if state.global_step == 1 and rank == 1:\n            raise RuntimeError('bad batch on rank 1')\n"
        "fsdp2nb.trainer_for(transformers.Trainer)(model=model, args=arguments(max_steps=4), train_dataset=data, "
        "callbacks=[Fail()]).train()")
    text = "\n".join(_error_lines(messages))
    assert "rank 1 raised RuntimeError" in text and "re-formed in place" in text, text
    assert "restarted" not in text
    after = dash.run("%%fsdp2\ntrainer.train()\nprint(kept, pid == os.getpid())")
    out = _stream(after)
    assert not _error_lines(after) and all(f"[{rank}] kept True" in out or "[all] kept True" in out
                                           for rank in (0, 1)), out
