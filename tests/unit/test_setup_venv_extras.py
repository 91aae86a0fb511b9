"""scripts/setup_venv.sh installs the extra it is given: `demo` for `make demo` (no test tools),
`test` when none is named. The venv's python is a stand-in that has torch and records pip's
arguments, so nothing is downloaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("arguments", "extra"), [((), "test"), (("test",), "test"), (("demo",), "demo")])
def test_the_named_extra_is_installed(tmp_path, arguments, extra):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "${{*:3}}" >> {tmp_path / 'pip.log'}; exit 0; fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    done = subprocess.run(["bash", "scripts/setup_venv.sh", str(tmp_path / "venv"), *arguments], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "pip.log").read_text().splitlines()[-1] == f"install -q -e .[{extra}]"


def test_the_demo_extra_is_a_kernel_and_a_notebook_runner_only():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {requirement.split(">")[0].split("<")[0].split("=")[0] for requirement in extras["demo"]}
    assert names == {"ipykernel", "jupyter_client", "nbclient", "nbformat"}
    assert not names & {"ray", "playwright", "jupyterlab", "trl", "mypy"}
