"""Progress of long work in a real kernel: one bar per cell, summed over 2 CPU ranks, with a text
form that names each task's end (what nbclient keeps), never an update per event."""

from __future__ import annotations

import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel

WORK = """%%fsdp2
import fsdp2nb
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
if rank == 0:
    save_tiny_checkpoint(model_dir, "llama")
dist.barrier()
model, tokenizer = fsdp2nb.load_model(model_dir, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
ckpt = fsdp2nb.Checkpointer(ckpt_dir, async_save=True).track(model=model)
ckpt.save(1)
ckpt.wait()
ckpt.load(1)
from fsdp2nb import export_hf
export_hf(model, export_dir)
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    assert k.execute("%fsdp2 start --cpu 2").status == "ok"
    yield k
    k.stop()


def test_a_cell_of_long_work_shows_one_bar_and_a_few_lines(kernel, tmp_path):
    paths = {name: str(tmp_path / name) for name in ("model_dir", "ckpt_dir", "export_dir")}
    setup = "\n".join(f"{name} = {path!r}" for name, path in paths.items())
    assert kernel.execute(f"{setup}\n%fsdp2 push {' '.join(paths)}").status == "ok"
    run = kernel.execute(WORK, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    # Progress bars only: not the path export_hf returns, nor a line saying where ranks wait.
    bars = [m["content"] for m in run.messages if m["msg_type"] in ("display_data", "update_display_data")
            and m["content"].get("transient", {}).get("display_id", "").startswith("fsdp2nb-progress-")]
    display_ids = {bar["transient"]["display_id"] for bar in bars}
    assert len(display_ids) == 1 and run.messages[0]["msg_type"] != "update_display_data"
    assert all("application/vnd.jupyter.widget-view+json" in bar["data"] for bar in bars)
    assert len(bars) <= 10, [bar["data"]["text/plain"] for bar in bars]  # tasks start and end, nothing else
    text = bars[-1]["data"]["text/plain"].splitlines()
    kinds = ["loading model weights", "saving step 1", "loading step 1", "exporting in Hugging Face format"]
    assert [line.split(":")[0] for line in text] == kinds, text
    assert all(": done, " in line and " in " in line for line in text), text


def test_a_load_through_from_pretrained_shows_its_start_and_end(kernel, tmp_path):
    """init="rank0": rank 0 reads the whole checkpoint, the others receive it; the bar counts
    rank 0's bytes, shown when the load starts and when it is done."""
    model_dir = str(tmp_path / "model")
    code = (f"%%fsdp2\nimport fsdp2nb\nfrom fsdp2nb.examples.tiny_models import save_tiny_checkpoint\n"
            f"if rank == 0:\n    save_tiny_checkpoint({model_dir!r}, 'llama')\ndist.barrier()\n"
            f"engine = fsdp2nb.FSDP2Engine(mixed_precision='fp32')\n"
            f"model, _ = fsdp2nb.load_model({model_dir!r}, init='rank0', engine=engine)\n")
    run = kernel.execute(code, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    bars = [m["content"]["data"]["text/plain"] for m in run.messages
            if m["msg_type"] in ("display_data", "update_display_data")
            and m["content"].get("transient", {}).get("display_id", "").startswith("fsdp2nb-progress-")]
    assert bars and bars[-1].startswith("loading model weights (from_pretrained): done, "), bars


ONE_TASK = ("%%fsdp2\nfrom fsdp2nb import progress\ntask = progress.start_task('save', 'step {n}', total_items=1)\n"
            "task.advance(num_items=1)\ntask.finish()")
LIVE_WIDGETS = "from ipywidgets.widgets import widget\nprint(len(widget._instances))"


def _bar_displays(run, msg_type: str) -> list[dict]:
    return [m["content"] for m in run.messages if m["msg_type"] == msg_type
            and m["content"].get("transient", {}).get("display_id", "").startswith("fsdp2nb-progress-")]


def test_old_bars_become_text_and_free_their_widgets(kernel):
    """A long session of saves keeps the widgets of the last MAX_LIVE_BARS bars, not one per cell."""
    from fsdp2nb.frontend.progress_bar import MAX_LIVE_BARS

    runs = [kernel.execute(ONE_TASK.format(n=n)) for n in range(MAX_LIVE_BARS)]
    assert all(run.status == "ok" for run in runs), runs[-1].traceback_text
    first_id = _bar_displays(runs[0], "display_data")[0]["transient"]["display_id"]
    before = int(kernel.execute(LIVE_WIDGETS).stdout)
    later = [kernel.execute(ONE_TASK.format(n=n)) for n in range(MAX_LIVE_BARS, MAX_LIVE_BARS + 10)]
    assert int(kernel.execute(LIVE_WIDGETS).stdout) == before  # each new bar's widgets replace an old one's
    retired = [update for update in _bar_displays(later[0], "update_display_data")
               if update["transient"]["display_id"] == first_id]
    assert len(retired) == 1 and list(retired[0]["data"]) == ["text/plain"], retired  # no widget in it
    assert retired[0]["data"]["text/plain"].startswith("step 0: done"), retired
