"""Run notebooks/quickstart.ipynb headless in a real kernel, write the executed copy beside it,
and end with what a person wants to know at a glance.

    python scripts/run_demo.py [NOTEBOOK]

The ranks are the machine's GPUs, or 2 CPU ranks without one. Nothing is downloaded.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

NotebookFailure = CellExecutionError | CellTimeoutError | DeadKernelError
"""What stops a run: a cell's error, a cell past CELL_TIMEOUT_S, a kernel that died."""

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CELL_TIMEOUT_S = 600
QUICKSTART = Path(__file__).resolve().parent.parent / "notebooks" / "quickstart.ipynb"


def execute(path: Path, out_path: Path | None = None) -> tuple[nbformat.NotebookNode, Path, NotebookFailure | None]:
    """Run every cell in a fresh kernel; the executed notebook is written to `out_path` (default:
    NAME.out.ipynb beside it) even when a cell fails."""
    notebook = nbformat.read(path, as_version=4)
    out_path = out_path or path.with_suffix(".out.ipynb")
    error = None
    # The kernel listens on Unix sockets in a private directory, not on TCP ports of localhost.
    with tempfile.TemporaryDirectory(prefix="fsdp2nb-kernel-") as sockets:
        kernel = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        client = NotebookClient(notebook, km=kernel, timeout=CELL_TIMEOUT_S,
                                resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as failure:
            error = failure
        finally:
            nbformat.write(notebook, out_path)
            if kernel.has_kernel:  # a kernel manager handed to nbclient is ours to shut down
                kernel.shutdown_kernel(now=True)
    return notebook, out_path, error


def tagged_text(notebook: nbformat.NotebookNode, tag: str) -> str:
    """The text a tagged cell printed (streams and plain-text displays), without colour codes."""
    parts = []
    for cell in notebook.cells:
        if tag not in cell.get("metadata", {}).get("tags", []):
            continue
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                parts.append(output.text)
            elif output.output_type in ("display_data", "execute_result"):
                parts.append(output.get("data", {}).get("text/plain", "") + "\n")
    return ANSI.sub("", "".join(parts))


def _search(pattern: str, text: str) -> re.Match | None:
    return re.search(pattern, text, flags=re.MULTILINE)


def quickstart_facts(notebook: nbformat.NotebookNode) -> dict[str, object]:
    """What the quickstart showed, read from its tagged cells' output; a missing fact is None."""
    started = _search(r"^started (\d+) ranks \((.+)\)$", tagged_text(notebook, "start"))
    devices = sorted(set(re.findall(r"rank \d+ on (\S+) holds", tagged_text(notebook, "load"))))
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([0-9.]+)", tagged_text(notebook, "train"))]
    evaluated = _search(r"after \d+ steps: loss ([0-9.]+) \(before training ([0-9.]+)\), perplexity ([0-9.]+)",
                        tagged_text(notebook, "sample_after"))
    saved = _search(r"saved step (\d+) in (\S+)", tagged_text(notebook, "save"))
    resumed = _search(r"resumed from \S+ at step (\d+)", tagged_text(notebook, "resume"))
    exported = _search(r"exported to (\S+)", tagged_text(notebook, "export"))
    generated = _search(r"^generated: (.*)$", tagged_text(notebook, "generate"))
    return {
        "num_ranks": int(started.group(1)) if started else None,
        "pool": started.group(2) if started else None,
        "devices": devices,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "eval_loss_before": float(evaluated.group(2)) if evaluated else None,
        "eval_loss_after": float(evaluated.group(1)) if evaluated else None,
        "eval_perplexity_after": float(evaluated.group(3)) if evaluated else None,
        "saved_step": int(saved.group(1)) if saved else None,
        "checkpoint_dir": saved.group(2) if saved else None,
        "resumed_step": int(resumed.group(1)) if resumed else None,
        "export_dir": exported.group(1) if exported else None,
        "generated": generated.group(1).strip() if generated else None,
    }


def summary(facts: dict[str, object], out_path: Path, elapsed_s: float) -> str:
    def known(value: object) -> str:
        return "(not reached)" if value is None or value == [] else str(value)

    loss = (f"{facts['first_loss']:.3f} at the first step, {facts['last_loss']:.3f} at the last"
            if facts["first_loss"] is not None else "(not reached)")
    evaluated = (f"{facts['eval_loss_before']:.3f} before training, {facts['eval_loss_after']:.3f} after "
                 f"(perplexity {facts['eval_perplexity_after']:.1f}), fsdp2nb.evaluate over the story's windows"
                 if facts["eval_loss_after"] is not None else "(not reached)")
    lines = [
        f"ranks       {known(facts['num_ranks'])} ({known(facts['pool'])}), devices: {', '.join(facts['devices']) or '?'}",
        f"loss        {loss}",
        f"eval loss   {evaluated}",
        f"checkpoint  step {known(facts['saved_step'])} written to {known(facts['checkpoint_dir'])}; "
        f"resumed at step {known(facts['resumed_step'])} after a restart of the ranks",
        f"export      {known(facts['export_dir'])}",
        f"generated   {known(facts['generated'])}",
        f"notebook    {out_path} (executed in {elapsed_s:.0f} s)",
        "next        make lab  (opens notebooks/quickstart.ipynb in JupyterLab)",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else QUICKSTART
    if not path.is_file():
        print(f"no notebook at {path}; give the path of an .ipynb file", file=sys.stderr)
        return 2
    print(f"running {path} headless (a fresh kernel and its ranks)...", flush=True)
    started = time.perf_counter()
    notebook, out_path, error = execute(path)
    elapsed_s = time.perf_counter() - started
    if error is not None:
        print(ANSI.sub("", str(error)), file=sys.stderr)
        print(f"\nthe demo stopped at the cell above; the executed notebook is {out_path}", file=sys.stderr)
        return 1
    if path.name == QUICKSTART.name:
        print("\n" + summary(quickstart_facts(notebook), out_path, elapsed_s))
        return 0
    for tag in [tag for cell in notebook.cells for tag in cell.get("metadata", {}).get("tags", [])]:
        print(f"--- {tag}\n{tagged_text(notebook, tag).rstrip()}")
    print(f"\nexecuted notebook: {out_path} ({elapsed_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
