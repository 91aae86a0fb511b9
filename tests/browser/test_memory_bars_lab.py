"""The dashboard's memory bars in JupyterLab, split into the tracked model's parameters, gradients,
optimizer state and the rest. The model (24 Linear(2048, 2048), 100 M parameters, 2 CPU ranks)
is large enough beside a rank's own 0.4 GiB for each part to be drawn wider than nothing; the
panel goes to /tmp/dash-shots/memory-bars.png (FSDP2NB_SHOTS moves it)."""

from __future__ import annotations

import nbformat

from tests.support.lab_page import Page

SETUP = """%%fsdp2 --cpu 2
import fsdp2nb, tempfile
from torch.distributed.fsdp import fully_shard
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = fsdp2nb.Checkpointer(tempfile.mkdtemp()).track(model=model, optimizer=optimizer)
model(torch.randn(4, 2048)).square().mean().backward()
optimizer.step()  # the gradients are kept (no zero_grad), so all three parts show
print("stepped")
"""
PARTS = ("params", "grads", "optimizer", "other")


def test_memory_bars_are_split_by_part(lab, browser, shots):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
                                               nbformat.v4.new_code_cell(SETUP)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab.root / "bars.ipynb")
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = Page(context.new_page())
    try:
        page.open(lab.url("bars.ipynb"))
        page.run(0)
        page.wait_done(0)
        page.run(1)
        page.wait_done(1, timeout_ms=300_000)
        assert "stepped" in page.output(1), page.output(1)
        dash = page.page.locator(".fsdp2nb-dashboard").first
        # The tracked sizes are read when the cell ends and reach the panel with the next snapshot.
        page.page.wait_for_function(
            "[...document.querySelectorAll(\".fsdp2nb-dashboard rect.fsdp2nb-part[data-part='grads']\")]"
            ".filter(r => +r.getAttribute('width') > 0).length == 2", timeout=60_000)
        for rank in (0, 1):
            row = dash.locator(f".fsdp2nb-rank[data-rank='{rank}']")
            widths = {part: int(row.locator(f"rect.fsdp2nb-part[data-part='{part}']").get_attribute("width"))
                      for part in PARTS}
            assert all(width > 0 for width in widths.values()), (rank, widths)
            assert widths["optimizer"] > widths["params"], widths  # AdamW: twice the parameters
            legend = row.locator(".fsdp2nb-mem").text_content()
            assert all(f"{part} " in legend for part in PARTS), legend
        page.shoot(shots / "memory-bars-page.png")
        dash.screenshot(path=str(shots / "memory-bars.png"))
    except Exception:
        page.page.screenshot(path=str(shots / "memory-bars-failure.png"))
        raise
    finally:
        context.close()
