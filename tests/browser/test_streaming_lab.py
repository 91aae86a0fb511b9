"""`fsdp2nb.generate(..., stream=True)` in JupyterLab and Notebook 7: the first prompt's completion
is seen growing in the cell's output while the cell runs, as one line updated in place, and ends
as the completion `generate` returned.

A tiny Llama (printable-character tokenizer) on 2 CPU ranks, slowed to a token every 50 ms by a
logits processor that sleeps, 30 tokens. The page samples the cell's outputs every 100 ms from
inside the browser (a sample taken from Python would wait behind a screenshot). Screenshots:
stream-<app>-during.png and stream-<app>-done.png in the shots folder."""

from __future__ import annotations

import ast
import re

import nbformat
import pytest

from tests.support.lab_page import Page

PROMPTS = ["The light", "Keeper of the lamp"]  # one a rank; rank 0's, the first, streams
NUM_TOKENS = 30

SETUP = """%%fsdp2 --cpu 2
import time, fsdp2nb
from transformers import LogitsProcessor, LogitsProcessorList
from fsdp2nb.examples import save_tiny_llama
if rank == 0:
    save_tiny_llama(MODEL_DIR, hidden_size=64)
dist.barrier()
model, tokenizer = fsdp2nb.load_model(MODEL_DIR, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
class Paced(LogitsProcessor):  # a token every 50 ms, as a bigger model would take
    def __call__(self, input_ids, scores):
        time.sleep(0.05)
        return scores
print("loaded")
"""

GENERATE = f"""%%fsdp2
streamed = fsdp2nb.generate(model, tokenizer, {PROMPTS!r}, max_new_tokens={NUM_TOKENS},
                            min_new_tokens={NUM_TOKENS}, do_sample=False, stream=True,
                            logits_processor=LogitsProcessorList([Paced()]))
if rank == 0:
    print("returned", repr(streamed[0]))
"""
GENERATE_CELL = 2

_SAMPLE = r"""(index) => {
  window.fsdp2nbSamples = [];
  window.fsdp2nbSampler = setInterval(() => {
    const cell = document.querySelectorAll('.jp-CodeCell')[index];
    const busy = cell.querySelector('.jp-InputArea-prompt').textContent.includes('*');
    const lines = [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent)
                                                                     .filter(t => t.includes('The light'));
    window.fsdp2nbSamples.push({busy, lines});
  }, 100);
}"""


def _notebook(path, model_dir: str) -> None:
    cells = [nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
             nbformat.v4.new_code_cell(SETUP.replace("%%fsdp2 --cpu 2\n", f"%%fsdp2 --cpu 2\nMODEL_DIR = {model_dir!r}\n")),
             nbformat.v4.new_code_cell(GENERATE)]
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, path)


# Notebook 7 (`/notebooks/PATH`) uses the same classes for its cells and outputs as JupyterLab: its
# variant runs with `make soak` (tests/browser/test_dashboard_lab.py covers Notebook 7 in the suite).
@pytest.mark.parametrize("app", ["lab", pytest.param("notebook7", marks=pytest.mark.soak)])
def test_streamed_completion_grows_during_the_cell(app, request, browser, shots):
    server = request.getfixturevalue(app)  # the session's Lab or Notebook 7 server, started on first use
    _notebook(server.root / "stream.ipynb", str(server.root / "stream-model"))
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = Page(context.new_page())
    try:
        page.open(server.url("stream.ipynb"))
        _streamed_completion_grows(page, shots, app)
    except Exception:
        page.page.screenshot(path=str(shots / f"stream-{app}-failure.png"))
        raise
    finally:
        context.close()


def _streamed_completion_grows(page: Page, shots, app: str) -> None:
    for index in (0, 1):
        page.run(index)
        page.wait_done(index, timeout_ms=300_000)
    assert "loaded" in page.output(1), page.output(1)

    page.page.evaluate(_SAMPLE, GENERATE_CELL)
    page.run(GENERATE_CELL)
    # Mid-stream: the line is shown and has grown twice, the cell still running (or the cell is done
    # and the assertions below say what was seen).
    page.page.wait_for_function(
        "(index) => new Set(window.fsdp2nbSamples.filter(s => s.busy).flatMap(s => s.lines)).size >= 3 || "
        "/\\[\\d+\\]/.test(document.querySelectorAll('.jp-CodeCell')[index].querySelector('.jp-InputArea-prompt').textContent)",
        arg=GENERATE_CELL, timeout=120_000, polling=50)
    page.page.locator(".jp-CodeCell").nth(GENERATE_CELL).scroll_into_view_if_needed()
    page.page.screenshot(path=str(shots / f"stream-{app}-during.png"))
    page.wait_done(GENERATE_CELL, timeout_ms=120_000)
    page.page.wait_for_timeout(300)  # a last sample of the finished cell
    samples = page.page.evaluate("clearInterval(window.fsdp2nbSampler), window.fsdp2nbSamples")
    page.page.screenshot(path=str(shots / f"stream-{app}-done.png"))

    output = page.output(GENERATE_CELL)
    assert "Warning" not in output, output  # nothing but the completion and what the cell printed
    returned = re.search(r"^\[0\] returned ('.*')$", output, re.MULTILINE)
    assert returned, output
    completion = ast.literal_eval(returned.group(1))
    assert len(completion) >= NUM_TOKENS // 2, completion  # the char tokenizer: a character a token

    final = samples[-1]
    assert not final["busy"] and len(final["lines"]) == 1, final  # one line, not one per update
    final_line = final["lines"][0].rstrip()
    assert final_line == "[0] The light" + completion.rstrip(), (final_line, completion)
    assert final_line.count("The light") == 1, final_line

    assert all(len(s["lines"]) <= 1 for s in samples), [s for s in samples if len(s["lines"]) > 1]
    during = []  # the line's successive states seen while the cell ran
    for sample in samples:
        if sample["busy"] and sample["lines"] and (not during or sample["lines"][0] != during[-1]):
            during.append(sample["lines"][0])
    assert len(during) >= 3, (during, final_line)
    assert all(final_line.startswith(state.rstrip()) for state in during), (during, final_line)
    lengths = [len(state.rstrip()) for state in during]
    assert lengths == sorted(set(lengths)), during  # each longer than the one before
    assert lengths[-1] <= len(final_line), during
