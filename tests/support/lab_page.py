"""A notebook open in JupyterLab or Notebook 7 through Playwright, and the training cells the
dashboard's browser tests put in it."""

from __future__ import annotations

SETUP = """%%fsdp2 --cpu 2
import time, fsdp2nb
from torch.distributed.fsdp import fully_shard
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = fsdp2nb.Checkpointer(CKPT, keep=None, memory_every=1).track(model=model, optimizer=optimizer)
target = torch.randn(64, 1, generator=torch.Generator().manual_seed(0))
"""

TRAIN_LOOP = """import os
saved_at = None
for step in range(1, 100_000):
    x = torch.randn(32, 64)
    loss = (model(x) - x @ target).pow(2).mean()
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    fsdp2nb.log(step, loss=loss.item())
    if ckpt.maybe_save(step):
        saved_at = step
    if rank == 0 and step % 25 == 0: print(f"step {step} loss {loss.item():.4f}", flush=True)
    stop = torch.tensor(float(os.path.exists(FLAG) or step > 6000))  # the test makes FLAG once it has seen what it checks
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item():
        break
    time.sleep(0.01)
ckpt.wait()
"""
"""A training loop with maybe_save and fsdp2nb.log that ends when the test makes FLAG. The ranks
agree on seeing FLAG (all_reduce): a rank that left the loop a step before the other would leave
it in FSDP's all-gather until the collective timeout (600 s), the cell running long after rank 0
had finished (issue 24's defect C)."""


def _bytes(frame: str | bytes) -> bytes:
    return frame if isinstance(frame, bytes) else frame.encode()


class Page:
    """The open notebook: run cells, read outputs, find the dashboard.

    Lab skips rendering cells scrolled out of view (content-visibility), and their innerText
    reads empty: a dashboard, prompt or output that may be out of view is read by its
    textContent, or scrolled into view first where its line breaks matter."""

    def __init__(self, page) -> None:
        self.page = page

    def open(self, url: str) -> None:
        """Open the notebook and wait until its kernel answered kernel_info (an idle indicator
        alone shows before the kernel's channels are connected, and a cell run then is lost)."""
        replies = []
        self.page.on("websocket", lambda ws: ws.on("framereceived", lambda frame: replies.append(1)
                                                   if b"kernel_info_reply" in _bytes(frame) else None))
        self.page.goto(url)
        self.page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=180_000)
        select = self.page.locator(".jp-Dialog button:has-text('Select')")
        if select.count():
            select.first.click()
        news = self.page.locator(".jp-toast-container button:has-text('No')")
        if news.count():
            news.first.click()
        if "/lab/" in url:  # Notebook 7 has no such indicator: the kernel_info_reply below suffices
            self.page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) "
                                        ".jp-Notebook-ExecutionIndicator[data-status=idle]", timeout=180_000)
        for _ in range(600):
            if replies:
                break
            self.page.wait_for_timeout(100)

    def _prompt(self, index: int) -> str:
        return f"document.querySelectorAll('.jp-CodeCell')[{index}].querySelector('.jp-InputArea-prompt').textContent"

    def run(self, index: int) -> None:
        """Run cell `index` and wait until the kernel took it (its prompt is `[*]` or numbered)."""
        self.page.locator(".jp-CodeCell").nth(index).locator(".jp-InputPrompt").click()
        self.page.keyboard.press("Shift+Enter")
        self.page.wait_for_function(f"/\\[(\\*|\\d+)\\]/.test({self._prompt(index)})", timeout=120_000)

    def wait_done(self, index: int, timeout_ms: int = 150_000) -> None:
        self.page.wait_for_function(f"/\\[\\d+\\]/.test({self._prompt(index)})", timeout=timeout_ms)

    def output(self, index: int) -> str:
        cell = self.page.locator(".jp-CodeCell").nth(index)
        cell.scroll_into_view_if_needed()  # innerText keeps the lines, and is empty while skipped
        return cell.locator(".jp-OutputArea").inner_text()

    def wait_for_output(self, index: int, text: str, timeout_ms: int = 180_000) -> None:
        """Wait until cell `index`'s output contains `text`, in view or not."""
        self.page.wait_for_function(
            f"document.querySelectorAll('.jp-CodeCell')[{index}].querySelector('.jp-OutputArea')"
            f".textContent.includes({text!r})", timeout=timeout_ms)

    def shoot(self, path) -> None:
        news = self.page.locator(".jp-toast-container button:has-text('No')")
        if news.count():  # the news toast would cover the dashboard
            news.first.click()
        self.page.locator(".fsdp2nb-dashboard").first.scroll_into_view_if_needed()
        self.page.screenshot(path=str(path), full_page=False)
