"""End to end in JupyterLab: a 2-rank CPU pool's dashboard, Save clicked during a training cell,
the step listed and each rank's memory split into parameters, gradients and optimizer state while
the cell still runs, then Load. Screenshots go to /tmp/dash-shots; with
FSDP2NB_DASHBOARD_SCREENSHOT=path the panel alone, during training, goes to path (the README's),
its checkpoints then written to ~/fsdp2nb-runs/run1 (removed afterwards) rather than a test's
temporary directory, which the panel would show."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import nbformat

from tests.support.lab_page import SETUP, TRAIN_LOOP, Page

TRAIN = ("%%fsdp2\n" + TRAIN_LOOP +
         'print("panel saw the step during the cell" if os.path.exists(FLAG) else "no flag", "saved at", saved_at)\n')


def _notebook(path, ckpt: str, flag: str) -> None:
    cells = [nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
             nbformat.v4.new_code_cell(SETUP.replace("%%fsdp2 --cpu 2\n", "%%fsdp2 --cpu 2\n" +
                                                     f"CKPT, FLAG = {ckpt!r}, {flag!r}\n")),
             nbformat.v4.new_code_cell(TRAIN)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def test_save_during_training_then_load(lab, browser, shots):
    readme_shot = bool(os.environ.get("FSDP2NB_DASHBOARD_SCREENSHOT"))
    ckpt = Path.home() / "fsdp2nb-runs" / "run1" if readme_shot else lab.root / "ckpt"
    flag = str(lab.root / "flag")
    _notebook(lab.root / "dash.ipynb", str(ckpt), flag)
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        _save_during_training_then_load(page, lab, shots, flag, step_dir=ckpt)
    except Exception:
        page.page.screenshot(path=str(shots / "failure.png"))  # what the page showed when it failed
        raise
    finally:
        context.close()
        if readme_shot:
            shutil.rmtree(ckpt.parent, ignore_errors=True)


def test_save_during_training_notebook7(notebook7, browser, shots):
    """Notebook 7 with its default settings: a Save click during a busy training cell is served
    before the cell ends (the click travels on a subshell, as in JupyterLab)."""
    ckpt, flag = notebook7.root / "ckpt", str(notebook7.root / "flag")
    _notebook(notebook7.root / "dash.ipynb", str(ckpt), flag)
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        page.open(notebook7.url("dash.ipynb"))
        (shots / "nb7").mkdir(exist_ok=True)
        _save_during_training(page, shots / "nb7", flag, ckpt, readme_shot=False)
    except Exception:
        page.page.screenshot(path=str(shots / "nb7-failure.png"))
        raise
    finally:
        context.close()


def _save_during_training_then_load(page: Page, lab, shots, flag: str, step_dir) -> None:
    page.open(lab.url("dash.ipynb"))
    dash = page.page.locator(".fsdp2nb-dashboard").first
    step, before = _save_during_training(page, shots, flag, step_dir)
    after = [dash.locator(f".fsdp2nb-rank[data-rank='{r}'] .fsdp2nb-mem").text_content() for r in (0, 1)]
    assert all(a != b for a, b in zip(after, before, strict=True)), (before, after)
    assert "params" in after[0] and "optimizer 0 B" not in after[0], after
    _check_memory_bars(dash)
    _load_then_delete_latest(page, dash, step, step_dir)
    dash.locator("button:has-text('all ranks')").click()
    page.page.wait_for_function("document.querySelectorAll('.fsdp2nb-plot polyline').length == 2", timeout=120_000)
    page.shoot(shots / "3-loaded.png")


def _save_during_training(page: Page, shots, flag: str, step_dir,
                          readme_shot: bool = True) -> tuple[int, list[str]]:
    """Start the pool and the training cell, click Save while it runs; returns the saved step
    and each rank's memory line from before training."""
    dash = page.page.locator(".fsdp2nb-dashboard").first

    page.run(0)
    page.wait_done(0)
    page.run(1)
    page.wait_done(1)
    assert "error" not in page.output(1).lower(), page.output(1)
    page.page.wait_for_function("document.querySelectorAll('.fsdp2nb-dashboard .fsdp2nb-rank').length == 2 && "
                                "![...document.querySelectorAll('.fsdp2nb-dashboard .fsdp2nb-mem')]"
                                ".some(e => e.textContent.includes('no reading'))", timeout=120_000)
    before = [dash.locator(f".fsdp2nb-rank[data-rank='{r}'] .fsdp2nb-mem").text_content() for r in (0, 1)]
    assert all(re.search(r"RSS [1-9][0-9.]* (MiB|GiB)", text) for text in before), before
    page.shoot(shots / "1-pool-started.png")

    page.run(2)
    page.wait_for_output(2, "step 50 ")
    clicked_at = time.monotonic()
    dash.locator("button:has-text('Save now')").click()
    # The saved step must show in the panel's list while the training cell still runs.
    page.page.wait_for_function(
        "[...document.querySelectorAll('.fsdp2nb-dashboard .fsdp2nb-steps option')].length > 0 && "
        "document.querySelector('.fsdp2nb-dashboard .fsdp2nb-message').textContent.includes('saved step')",
        timeout=180_000)
    saved_after_s = time.monotonic() - clicked_at  # measured, not asserted: it depends on the machine
    assert "[*]" in page.page.locator(".jp-CodeCell").nth(2).locator(".jp-InputArea-prompt").text_content()
    assert "--cpu 2 · busy" in dash.locator(".widget-html").first.text_content()
    (shots / "click-to-saved.txt").write_text(f"{saved_after_s:.2f} s from the Save click to 'saved step N'\n")
    page.page.wait_for_function("document.querySelector('.fsdp2nb-plot') && "
                                "+document.querySelector('.fsdp2nb-plot').dataset.points > 20", timeout=120_000)
    _check_loss_plot(dash)
    page.page.wait_for_function("(document.querySelector('.fsdp2nb-dashboard .fsdp2nb-memory-step') || "
                                "{textContent: ''}).textContent.includes('in memory')", timeout=60_000)
    _wait_for_split_during_training(page, dash)
    page.shoot(shots / "2-saved-during-training.png")
    if readme_shot and os.environ.get("FSDP2NB_DASHBOARD_SCREENSHOT"):
        dash.screenshot(path=os.environ["FSDP2NB_DASHBOARD_SCREENSHOT"])
    message = dash.locator(".fsdp2nb-message").text_content()
    step = int(re.search(r"saved step (\d+) in [0-9.]+ s", message).group(1))
    assert f"saving step {step}: done" in dash.locator(".fsdp2nb-progress[data-kind='save']").text_content()
    open(flag, "w").close()
    page.wait_done(2)
    # The panel is refreshed as the cell ends, not at its next periodic refresh.
    page.page.wait_for_function("document.querySelector('.fsdp2nb-dashboard .widget-html')"
                                ".textContent.includes('--cpu 2 · ready')", timeout=30_000)
    page.shoot(shots / "2b-cell-ended.png")
    output = page.output(2)
    assert "panel saw the step during the cell" in output and f"saved at {step}" in output, output
    assert f"saving step {step}: done" in output, output  # the cell's own progress bar
    assert (step_dir / f"step-{step:06d}").is_dir()
    return step, before


def _wait_for_split_during_training(page: Page, dash) -> None:
    """Each rank's memory line shows gradients and optimizer state while the cell still runs: the
    split is read again after optimizer steps, not only when a cell ends."""
    page.page.wait_for_function(
        "[0, 1].every(r => { const t = document.querySelector(`.fsdp2nb-dashboard .fsdp2nb-rank[data-rank='${r}'] "
        ".fsdp2nb-mem`).textContent; return t.includes('grads') && !t.includes('grads 0 B') "
        "&& !t.includes('optimizer 0 B'); })", timeout=60_000)
    assert "[*]" in page.page.locator(".jp-CodeCell").nth(2).locator(".jp-InputArea-prompt").text_content()


def _load_then_delete_latest(page: Page, dash, step: int, step_dir) -> None:
    label = dash.locator(".fsdp2nb-steps option").first.text_content()
    assert re.match(rf"step\s+{step}\s", label) and "LATEST" in label, label
    dash.locator(".fsdp2nb-steps select").select_option(label=label)
    dash.locator("button:has-text('Load selected')").click()
    page.page.wait_for_function("document.querySelector('.fsdp2nb-dashboard .fsdp2nb-confirm')"
                                f".textContent.includes('Load step {step}?')", timeout=120_000)
    dash.locator(".fsdp2nb-confirm button:has-text('Yes')").click()
    page.page.wait_for_function("document.querySelector('.fsdp2nb-dashboard .fsdp2nb-message')"
                                f".textContent.includes('loaded step {step}')", timeout=180_000)
    dash.locator("button:has-text('Delete selected')").click()  # LATEST: asked twice, then cancelled
    page.page.wait_for_function("document.querySelector('.fsdp2nb-dashboard .fsdp2nb-confirm')"
                                f".textContent.includes('Delete step {step}?')", timeout=120_000)
    dash.locator(".fsdp2nb-confirm button:has-text('Yes')").click()
    page.page.wait_for_function("document.querySelector('.fsdp2nb-dashboard .fsdp2nb-confirm')"
                                f".textContent.includes('Step {step} is LATEST')", timeout=120_000)
    dash.locator(".fsdp2nb-confirm button:has-text('Cancel')").click()
    assert (step_dir / f"step-{step:06d}").is_dir()


def _check_memory_bars(dash) -> None:
    """Each rank's bar has a used part wider than nothing, and a history of at least two readings."""
    for rank in (0, 1):
        row = dash.locator(f".fsdp2nb-rank[data-rank='{rank}']")
        used = [int(rect.get_attribute("width")) for rect in row.locator("svg.fsdp2nb-bar rect.fsdp2nb-used").all()]
        assert sum(used) > 0, (rank, used)
        history = row.locator("svg.fsdp2nb-spark polyline").get_attribute("points")
        assert len(history.split()) >= 2, (rank, history)


def _check_loss_plot(dash) -> None:
    """The loss line has a drawn point per logged step (thinned past 400), not only a count."""
    points = dash.locator(".fsdp2nb-plot polyline").first.get_attribute("points").split()
    assert len(points) > 20 and len(set(points)) > 1, points[:5]
