"""A kept pool in JupyterLab: a `--bg` training run goes on through Kernel > Restart Kernel, the
restarted kernel attaches the pool, its dashboard shows the ranks and the run, and its Save is
served by the run's own `ckpt.maybe_save` (the checkpointer the lost kernel's cells made).

The Lab server and its kernels get a TMPDIR of this test's own: kept pools live under the user's
state directory there, so no other test (or checkout) sees this one's, and the test ends with no
process left (`%fsdp2 stop`, else the agent is killed).

With FSDP2NB_KEPT_SCREENSHOT=path the page after attach goes to path too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile

import nbformat
import psutil
import pytest

from tests.browser.conftest import Lab, _quiet_settings
from tests.support.lab_page import SETUP, TRAIN_LOOP, Page

pytestmark = pytest.mark.timeout(900)

TRAIN_BG = ("%%fsdp2 --bg --name train\n" + TRAIN_LOOP +
            'if rank == 0: print("run ended by the flag" if os.path.exists(FLAG) else "no flag", '
            '"saved at", saved_at, flush=True)\n')

START, SET_UP, TRAIN, LOAD_AGAIN, ATTACH, WAIT, CHECK, STOP = range(8)


def _notebook(path, ckpt: str, flag: str) -> None:
    setup = SETUP.replace("%%fsdp2 --cpu 2\n", f"%%fsdp2\nCKPT, FLAG = {ckpt!r}, {flag!r}\n")
    cells = ["%load_ext fsdp2nb\n%fsdp2 start --cpu 2 --keep --name lab", setup, TRAIN_BG,
             "%load_ext fsdp2nb", "%fsdp2 attach lab", "%fsdp2 wait",
             '%%fsdp2\nprint("ranks still have saved_at =", saved_at)', "%fsdp2 stop"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


def _kept_agents(tmpdir: str) -> list[int]:
    base = os.path.join(tmpdir, f"fsdp2nb-{os.getuid()}", "kept")
    pids = []
    for name in os.listdir(base) if os.path.isdir(base) else ():
        try:
            with open(os.path.join(base, name, "pool.json")) as meta:
                pids.append(json.load(meta)["agent"][0])
        except (OSError, ValueError, KeyError):
            pass
    return pids


@pytest.fixture
def kept_lab(tmp_path, monkeypatch):
    """A Lab server of this test's own whose kernels keep their pools under a fresh TMPDIR."""
    if not shutil.which("chromium") and not os.path.exists(os.environ.get("FSDP2NB_CHROMIUM", "/usr/bin/chromium")):
        pytest.skip("chromium is missing: `apt-get install -y chromium` (make test does it as root)")
    pytest.importorskip("playwright", reason="pip install playwright (the test extras)")
    tmpdir = tempfile.mkdtemp(prefix="kl-")  # short: the kernels' Unix sockets live under it
    monkeypatch.setenv("TMPDIR", tmpdir)
    root, fresh = tmp_path / "root", tmp_path / "fresh"
    root.mkdir()
    fresh.mkdir()
    _quiet_settings(fresh / "settings")
    server = Lab(root, fresh)
    server.tmpdir = tmpdir
    try:
        yield server
    finally:
        server.stop()
        for pid in _kept_agents(tmpdir):  # what a failed test left running
            try:
                agent = psutil.Process(pid)
                ranks = agent.children(recursive=True)
                os.kill(pid, signal.SIGKILL)
                for rank in ranks:
                    rank.kill()
            except psutil.Error:
                pass
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_attach_after_restart_kernel_picks_up_the_run(kept_lab, browser, shots):
    ckpt, flag = kept_lab.root / "ckpt", kept_lab.root / "flag"
    _notebook(kept_lab.root / "kept.ipynb", str(ckpt), str(flag))
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        page.open(kept_lab.url("kept.ipynb"))
        _attach_after_restart(page, kept_lab, shots, ckpt, flag)
    except Exception:
        page.page.screenshot(path=str(shots / "kept-failure.png"))
        raise
    finally:
        context.close()
    assert _kept_agents(kept_lab.tmpdir) == []  # `%fsdp2 stop` ended the pool and removed its directory


def _dashboard_of(index: int) -> str:
    """The dashboard shown in cell `index`'s output (the restarted kernel's, not the lost one's)."""
    return f"document.querySelectorAll('.jp-CodeCell')[{index}].querySelector('.fsdp2nb-dashboard')"


def _save(page: Page, index: int, after: int | None) -> int:
    """Click Save in the dashboard of cell `index`; the step it reports saved (newer than `after`)."""
    dash = page.page.locator(".jp-CodeCell").nth(index).locator(".fsdp2nb-dashboard")
    dash.locator("button:has-text('Save now')").click()
    page.page.wait_for_function(f"{_dashboard_of(index)}.querySelector('.fsdp2nb-message').textContent"
                                ".includes('saved step')", timeout=180_000)
    message = dash.locator(".fsdp2nb-message").text_content()
    step = int(re.search(r"saved step (\d+)", message).group(1))
    assert after is None or step > after, (after, message)  # a fresh save, not the old kernel's
    return step


def _attach_after_restart(page: Page, lab: Lab, shots, ckpt, flag) -> None:
    for index in (START, SET_UP):
        page.run(index)
        page.wait_done(index)
    assert "kept as 'lab'" in page.output(START), page.output(START)
    assert "error" not in page.output(SET_UP).lower(), page.output(SET_UP)
    page.page.wait_for_function(f"{_dashboard_of(START)}.querySelectorAll('.fsdp2nb-rank').length == 2",
                                timeout=120_000)
    page.run(TRAIN)
    page.wait_done(TRAIN, timeout_ms=60_000)  # --bg: the cell replies at once, the run goes on
    page.wait_for_output(TRAIN, "step 50 ")
    before = _save(page, START, after=None)  # a save served for the first kernel
    assert (ckpt / f"step-{before:06d}").is_dir()

    _restart_kernel(page)
    page.run(LOAD_AGAIN)
    page.wait_done(LOAD_AGAIN)
    assert page.page.locator(".jp-CodeCell").nth(LOAD_AGAIN).locator(".jp-InputArea-prompt").text_content() == "[1]:"
    page.run(ATTACH)
    page.wait_done(ATTACH)
    attached = page.output(ATTACH)
    assert "attached kept pool 'lab': 2 ranks (--cpu 2)" in attached, attached
    assert re.search(r"In\[\d+\] of kernel \d+ \(train\) is still running on ranks 0-1;", attached), attached
    assert "last lines of rank 0's log" in attached and "  step " in attached, attached  # printed while detached

    dash = page.page.locator(".jp-CodeCell").nth(ATTACH).locator(".fsdp2nb-dashboard")
    page.page.wait_for_function(f"{_dashboard_of(ATTACH)} && "
                                f"{_dashboard_of(ATTACH)}.querySelectorAll('.fsdp2nb-rank').length == 2 && "
                                f"![...{_dashboard_of(ATTACH)}.querySelectorAll('.fsdp2nb-mem')]"
                                ".some(e => e.textContent.includes('no reading'))", timeout=120_000)
    header = dash.locator(".widget-html").first.text_content()
    assert re.search(r"background run In\[\d+\] of kernel \d+ \(train\) running", header), header
    assert "--cpu 2" in header, header
    for rank in (0, 1):
        assert re.search(r"RSS [1-9][0-9.]* (MiB|GiB)", dash.locator(f".fsdp2nb-rank[data-rank='{rank}'] "
                                                                     ".fsdp2nb-mem").text_content())
    dash.scroll_into_view_if_needed()
    page.page.screenshot(path=str(shots / "kept-attached.png"))
    if os.environ.get("FSDP2NB_KEPT_SCREENSHOT"):
        dash.screenshot(path=os.environ["FSDP2NB_KEPT_SCREENSHOT"])

    after = _save(page, ATTACH, after=before)  # served by the run's maybe_save, for this kernel
    assert (ckpt / f"step-{after:06d}").is_dir()
    page.page.screenshot(path=str(shots / "kept-saved-after-attach.png"))

    flag.touch()
    page.run(WAIT)
    page.wait_done(WAIT)
    assert "error" not in page.output(WAIT).lower(), page.output(WAIT)
    page.wait_for_output(ATTACH, "saved at", timeout_ms=60_000)  # the run's last line, in the attach cell
    assert f"run ended by the flag saved at {after}" in page.output(ATTACH), page.output(ATTACH)
    page.run(CHECK)
    page.wait_done(CHECK)
    assert f"[all] ranks still have saved_at = {after}" in page.output(CHECK), page.output(CHECK)
    page.run(STOP)
    page.wait_done(STOP)
    assert "pool stopped" in page.output(STOP), page.output(STOP)


def _restart_kernel(page: Page) -> None:
    """Kernel > Restart Kernel…, then the dialog's Restart; returns once the new kernel is idle."""
    page.page.locator(".lm-MenuBar-itemLabel:text-is('Kernel')").click()
    page.page.locator(".lm-Menu-item[data-command='kernelmenu:restart']").click()
    page.page.locator(".jp-Dialog button:has-text('Restart')").click()
    page.page.wait_for_selector(".jp-Dialog", state="detached", timeout=30_000)
    page.page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) "
                                ".jp-Notebook-ExecutionIndicator[data-status=idle]", timeout=120_000)
