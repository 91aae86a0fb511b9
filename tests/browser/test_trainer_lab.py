"""End to end in JupyterLab: tqdm bars from two ranks, then a Hugging Face Trainer with
fsdp2nb.TrainerCallback that the dashboard's "Save now" makes write a `checkpoint-N` while it
trains. One notebook, one Lab start. Screenshots go to the test's tmp dir and /tmp/shots-hf."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest

from tests.support.lab_page import Page

pytest.importorskip("transformers")

MAX_STEPS = 2000
"""A cap never reached: the test ends training with FLAG once it has seen the save."""

SETUP = """%%fsdp2 --cpu 2
import os, time, torch, transformers, fsdp2nb
rows = torch.randint(3, 131, (64, 12), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": row, "labels": row} for row in rows]
model, _ = fsdp2nb.load_model(MODEL_DIR, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))

class UntilFlag(transformers.TrainerCallback):
    \"\"\"Slow steps, and training ends once the test made FLAG: the ranks agree on seeing it (a
    rank that stopped a step before the other would leave it waiting in a collective).\"\"\"
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.05)
        seen = torch.tensor(float(os.path.exists(FLAG)))
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if seen.item():
            control.should_training_stop = True
"""

BARS = """%%fsdp2
from tqdm import tqdm
for i in tqdm(range(12), desc="batches"):
    time.sleep(0.25)
print("bars done")
"""

TRAIN = f"""%%fsdp2
args = transformers.TrainingArguments(output_dir=OUT, max_steps={MAX_STEPS}, per_device_train_batch_size=2,
                                      report_to="none", use_cpu=True, logging_steps=1, save_strategy="no")
trainer = fsdp2nb.trainer_for(transformers.Trainer)(model=model, args=args, train_dataset=data,
                                                    callbacks=[UntilFlag(), fsdp2nb.TrainerCallback()])
trainer.train()
print("trained to step", trainer.state.global_step)
"""
BARS_CELL, TRAIN_CELL = 2, 3


def _notebook(path: Path, model_dir: Path, out: Path, flag: Path) -> None:
    constants = f"MODEL_DIR, OUT, FLAG = {str(model_dir)!r}, {str(out)!r}, {str(flag)!r}\n"
    cells = [nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
             nbformat.v4.new_code_cell(SETUP.replace("%%fsdp2 --cpu 2\n", "%%fsdp2 --cpu 2\n" + constants)),
             nbformat.v4.new_code_cell(BARS), nbformat.v4.new_code_cell(TRAIN)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def test_tqdm_bars_then_save_now_during_trainer_train(lab, browser, tmp_path):
    from fsdp2nb.examples.tiny_models import save_tiny_checkpoint

    model_dir = save_tiny_checkpoint(lab.root / "model", "llama")
    out, flag = lab.root / "trainer-out", lab.root / "trainer-flag"
    _notebook(lab.root / "trainer.ipynb", model_dir, out, flag)
    shots = tmp_path / "shots"
    shots.mkdir()
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        page.open(lab.url("trainer.ipynb"))
        for cell in (0, 1):
            page.run(cell)
            page.wait_done(cell, timeout_ms=240_000)
        assert "error" not in page.output(1).lower(), page.output(1)
        _check_bars(page, shots)
        _save_during_training(page, shots, out, flag)
    except Exception:
        page.page.screenshot(path=str(shots / "failure.png"))  # what the page showed when it failed
        raise
    finally:
        context.close()
        copies = Path("/tmp/shots-hf")
        copies.mkdir(exist_ok=True)
        for shot in shots.glob("*.png"):
            shutil.copy(shot, copies / shot.name)


def _check_bars(page: Page, shots: Path) -> None:
    """One line per rank, labelled at its start, showing only its final state, and no stderr block."""
    page.run(BARS_CELL)
    page.wait_done(BARS_CELL)
    cell = page.page.locator(".jp-CodeCell").nth(BARS_CELL)
    cell.screenshot(path=str(shots / "tqdm-cell.png"))
    lines = [line for line in page.output(BARS_CELL).splitlines() if line.strip()]
    bars = [line for line in lines if "%|" in line]
    assert sorted(line[:3] for line in bars) == ["[0]", "[1]"], lines
    assert all(re.match(r"\[\d\] batches: 100%\|█+\| 12/12 \[", line) for line in bars), bars
    assert lines[-1] == "[all] bars done", lines
    stderr = cell.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    assert stderr.count() == 0, stderr.all_inner_texts()


def _save_during_training(page: Page, shots: Path, out: Path, flag: Path) -> None:
    dash = page.page.locator(".fsdp2nb-dashboard").first
    page.run(TRAIN_CELL)
    # Trainer's progress in the panel, a few steps in: the click lands mid-training.
    page.page.wait_for_function(
        "(() => { const p = document.querySelector(\".fsdp2nb-dashboard .fsdp2nb-progress[data-kind='train']\");"
        f" const m = p && p.textContent.match(/step (\\d+) of {MAX_STEPS}/); return m && +m[1] >= 3; }})()",
        timeout=240_000)
    # Lab skips rendering cells out of view (content-visibility), and their innerText is then
    # empty: the panel is read by its text content, wherever it is scrolled.
    progress = dash.locator(".fsdp2nb-progress[data-kind='train']")
    assert re.search(rf"training: step \d+ of {MAX_STEPS} \(\d+%\) · [0-9.]+ steps/s · \d+ s left",
                     progress.text_content()), progress.text_content()
    page.shoot(shots / "panel-trainer-progress.png")
    dash.screenshot(path=str(shots / "panel-trainer-progress-only.png"))
    dash.locator("button:has-text('Save now')").click()
    page.page.wait_for_function(
        "document.querySelector('.fsdp2nb-dashboard .fsdp2nb-message').textContent.includes('saved step') && "
        "document.querySelector('.fsdp2nb-dashboard .fsdp2nb-trainer-checkpoints')?.textContent"
        ".includes('checkpoint-')", timeout=180_000)
    message = dash.locator(".fsdp2nb-message").text_content()
    step = int(re.search(r"saved step (\d+)", message).group(1))
    listing = dash.locator(".fsdp2nb-trainer-checkpoints").first.text_content()  # the widget and its markup
    assert re.search(rf"checkpoint-{step} · .* · 2 ranks", listing) and "incomplete" not in listing, listing
    # Training has not ended: the cell runs until the test makes FLAG.
    assert "[*]" in page.page.locator(".jp-CodeCell").nth(TRAIN_CELL).locator(".jp-InputArea-prompt").text_content()
    assert (out / f"checkpoint-{step}" / "fsdp2nb_dcp" / ".metadata").is_file()
    assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    page.shoot(shots / "panel-saved-during-training.png")
    flag.touch()
    page.wait_done(TRAIN_CELL, timeout_ms=240_000)
    output = page.output(TRAIN_CELL)
    trained_to = int(re.search(r"trained to step (\d+)", output).group(1))
    assert step < trained_to < MAX_STEPS, output
    assert "Traceback" not in output and "Error" not in output, output
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == [f"checkpoint-{step}"]
