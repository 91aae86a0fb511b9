"""A profiled cell in JupyterLab: under the cell's output, the straggler's line, the per-rank table
and the timeline (inline SVG, one lane per rank), and the dashboard's time bars beside the memory.
Rank 1 sleeps before each collective, so it is named and the other lanes show waiting. The
output goes to /tmp/dash-shots/profile.png and the dashboard to profile-dashboard.png."""

from __future__ import annotations

import nbformat

from tests.support.lab_page import Page

PROFILED = """%%fsdp2 --profile --cpu 3
import time
x = torch.ones(100_000)
for step in range(4):
    y = (x @ x) * torch.randn(200, 200).matmul(torch.randn(200, 200)).sum()
    if rank == 1:
        time.sleep(0.1)
    dist.all_reduce(x)
print("profiled")
"""


def test_a_profiled_cell_shows_its_table_and_timeline(lab, browser, shots):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%load_ext fsdp2nb"),
                                               nbformat.v4.new_code_cell(PROFILED)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, lab.root / "profile.ipynb")
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = Page(context.new_page())
    try:
        page.open(lab.url("profile.ipynb"))
        page.run(0)
        page.wait_done(0)
        page.run(1)
        page.wait_done(1, timeout_ms=300_000)
        assert "profiled" in page.output(1), page.output(1)
        view = page.page.locator(".fsdp2nb-profile").first
        view.wait_for(timeout=60_000)  # the ranks send their profiles after the cell: it replaces a placeholder
        assert page.page.locator(".fsdp2nb-profile-pending").count() == 0
        assert "straggler: rank 1" in view.inner_text()
        rows = view.locator("table.fsdp2nb-profile-table").first.locator("tr")
        assert rows.count() == 4  # the header and one row per rank
        lanes = view.locator("svg.fsdp2nb-timeline text")
        assert [lanes.nth(i).text_content() for i in range(3)] == ["rank 0", "rank 1", "rank 2"]
        assert view.locator("svg.fsdp2nb-timeline g.waiting rect").count() > 0
        page.page.wait_for_function(  # the dashboard draws the bars with its next refresh
            "document.querySelectorAll('.fsdp2nb-dashboard svg.fsdp2nb-time').length == 3", timeout=60_000)
        view.screenshot(path=str(shots / "profile.png"))
        page.page.locator(".fsdp2nb-dashboard").first.screenshot(path=str(shots / "profile-dashboard.png"))
    except Exception:
        page.page.screenshot(path=str(shots / "profile-failure.png"))
        raise
    finally:
        context.close()
