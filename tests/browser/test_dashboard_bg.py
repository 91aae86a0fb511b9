"""Issue 14: in JupyterLab and Notebook 7, a Save click during a `%%fsdp2 --bg` run is served while
the run goes (the kernel is idle, so other cells run meanwhile), and the step lands on disk."""

from __future__ import annotations

import re

import nbformat
import pytest

from tests.support.lab_page import SETUP, TRAIN_LOOP, Page

TRAIN_BG = ("%%fsdp2 --bg --name train\n" + TRAIN_LOOP +
            'if rank == 0: print("run ended by the flag" if os.path.exists(FLAG) else "no flag", '
            '"saved at", saved_at, flush=True)\n')


def _bg_notebook(path, ckpt: str, flag: str) -> None:
    setup = SETUP.replace("%%fsdp2 --cpu 2\n", f"%%fsdp2 --cpu 2\nCKPT, FLAG = {ckpt!r}, {flag!r}\n")
    cells = [nbformat.v4.new_code_cell("%load_ext fsdp2nb"), nbformat.v4.new_code_cell(setup),
             nbformat.v4.new_code_cell(TRAIN_BG),
             nbformat.v4.new_code_cell('print("run done:", train.done())'),
             nbformat.v4.new_code_cell("train.wait(); print('waited:', train.state)")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


# Notebook 7 (`/notebooks/PATH`) uses the same classes for its cells and outputs as JupyterLab: its
# variant runs with `make soak` (tests/browser/test_dashboard_lab.py covers Notebook 7 in the suite).
@pytest.mark.parametrize(("app", "name"), [("lab", "bg"), pytest.param("notebook7", "nb7-bg", marks=pytest.mark.soak)],
                         ids=["lab", "notebook7"])
def test_save_during_background_run(app, name, request, browser, shots):
    server = request.getfixturevalue(app)  # the session's Lab or Notebook 7 server, started on first use
    ckpt, flag = server.root / "ckpt-bg", server.root / "flag-bg"
    _bg_notebook(server.root / "bg.ipynb", str(ckpt), str(flag))
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        page.open(server.url("bg.ipynb"))
        _save_during_background_run(page, shots, ckpt, flag, name)
    except Exception:
        page.page.screenshot(path=str(shots / f"{name}-failure.png"))
        raise
    finally:
        context.close()


def _save_during_background_run(page: Page, shots, ckpt, flag, name: str) -> None:
    dash = page.page.locator(".fsdp2nb-dashboard").first
    for index in (0, 1):
        page.run(index)
        page.wait_done(index)
    assert "error" not in page.output(1).lower(), page.output(1)
    page.page.wait_for_function("document.querySelectorAll('.fsdp2nb-dashboard .fsdp2nb-rank').length == 2",
                                timeout=120_000)

    page.run(2)
    page.wait_done(2, timeout_ms=60_000)  # --bg: the cell replies at once, the run goes on
    page.wait_for_output(2, "step 50 ")
    dash.locator("button:has-text('Save now')").click()
    page.page.wait_for_function(
        "[...document.querySelectorAll('.fsdp2nb-dashboard .fsdp2nb-steps option')].length > 0 && "
        "document.querySelector('.fsdp2nb-dashboard .fsdp2nb-message').textContent.includes('saved step')",
        timeout=180_000)
    step = int(re.search(r"saved step (\d+)", dash.locator(".fsdp2nb-message").text_content()).group(1))
    header = dash.locator(".widget-html").first.text_content()
    assert re.search(r"background run In\[\d+\] \(train\) running", header), header
    label = dash.locator(".fsdp2nb-steps option").first.text_content()
    assert re.match(rf"step\s+{step}\s", label), label

    page.run(3)  # another cell runs meanwhile, and sees the run still going
    page.wait_done(3, timeout_ms=60_000)
    assert "run done: False" in page.output(3), page.output(3)
    page.shoot(shots / f"{name}-saved-during-run.png")

    flag.touch()
    page.run(4)
    page.wait_done(4)
    assert "waited: done" in page.output(4), page.output(4)
    page.wait_for_output(2, "saved at", timeout_ms=120_000)
    output = page.output(2)
    assert f"run ended by the flag saved at {step}" in output, output
    assert (ckpt / f"step-{step:06d}").is_dir()
