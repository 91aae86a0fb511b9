"""Run a notebook headless in a real kernel and print each cell's output as it would appear."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _render(output: dict) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return ANSI.sub("", "\n".join(output.traceback)) + "\n"
    data = output.get("data", {})
    return data.get("text/plain", f"<{', '.join(data)}>") + "\n"


def main(path: str) -> int:
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    client = NotebookClient(notebook, timeout=900, kernel_name="python3", allow_errors=False)
    try:
        client.execute()
    finally:
        out_path = Path(path).with_suffix(".out.ipynb")
        nbformat.write(notebook, out_path)
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            print(f"\n>>> {cell.source.splitlines()[0] if cell.source else ''}")
            for output in cell.get("outputs", []):
                sys.stdout.write(_render(output))
        print(f"\nexecuted notebook written to {out_path}")
    print(f"demo finished in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "notebooks/demo.ipynb"))
