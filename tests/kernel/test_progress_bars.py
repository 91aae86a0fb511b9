"""tqdm on the ranks, as JupyterLab and nbclient see it: one line per rank, labelled at its start,
updated in place and left showing its final state; no stale percentages left as lines."""

import re

import nbformat
from nbclient import NotebookClient

from tests.support.kernel_client import WITHOUT_GPUS

SHARES_THE_POOL = True  # tests/kernel/conftest.py: no test here restarts, stops or kills the pool

TQDM_LOOP = ("%%fsdp2\nimport time\nfrom tqdm import tqdm\nprint('before')\n"
             "for i in tqdm(range(8)):\n    time.sleep(0.2)\nprint('after')")
FINAL = re.compile(r"\[(\d)\] 100%\|█+\| 8/8 \[")


def _screen(messages: list[dict]) -> dict[str, str]:
    """What each display with an id shows once every update has been applied."""
    shown: dict[str, str] = {}
    for message in messages:
        content = message["content"]
        display_id = content.get("transient", {}).get("display_id")
        if message["msg_type"] in ("display_data", "update_display_data") and display_id:
            if message["msg_type"] == "display_data" or display_id in shown:
                shown[display_id] = content["data"].get("text/plain", "")
    return shown


def test_a_tqdm_bar_is_one_line_per_rank_updated_in_place(kernel):
    run = kernel.execute(TQDM_LOOP, timeout=120)
    assert run.status == "ok", run.traceback_text
    assert run.stdout == "[all] before\n[all] after\n"
    assert "%|" not in run.stderr, run.stderr  # no intermediate state left as a line of text
    bars = [text for text in _screen(run.messages).values() if text.startswith("[")]
    assert sorted(FINAL.match(text).group(1) for text in bars) == ["0", "1"], bars
    updates = [m for m in run.messages if m["msg_type"] == "update_display_data"]
    assert len(updates) >= 2  # it moved while the cell ran


def test_nbclient_keeps_the_final_line_of_each_rank_only(monkeypatch):
    for name, value in WITHOUT_GPUS.items():
        monkeypatch.setenv(name, value)
    cells = ["%load_ext fsdp2nb", "%%fsdp2 --cpu 2 --no-dashboard\nx = 1",
             TQDM_LOOP, "%fsdp2 stop"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    outputs = notebook.cells[2].outputs
    texts = [o.get("text") or o.get("data", {}).get("text/plain", "") for o in outputs]
    bars = [text for text in texts if "%|" in text]
    assert sorted(FINAL.match(text).group(1) for text in bars) == ["0", "1"], texts
    assert "".join(o.text for o in outputs if o.output_type == "stream") == "[all] before\n[all] after\n"
