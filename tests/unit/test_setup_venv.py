"""scripts/setup_venv.sh without a GPU: torch from the CPU-only index when it answers, from the
plain package index when it does not. The venv's python is a stand-in that records pip's
arguments (nothing is downloaded) and runs everything else, the index probe included, for real."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_venv(tmp_path):
    """A venv whose python has no torch (until `has-torch` exists) and logs pip calls; PATH has an nvidia-smi that finds no GPU."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then [ -e {tmp_path / 'has-torch'} ]; exit; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "${{*:3}}" >> {tmp_path / 'pip.log'}; exit 0; fi
exec {sys.executable} "$@"
""")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    for stub in (python, tools / "nvidia-smi"):
        stub.chmod(0o755)
    return tmp_path


def _setup(fake_venv: Path, index: str) -> tuple[list[str], str]:
    env = {**os.environ, "FSDP2NB_TORCH_INDEX": index, "PATH": f"{fake_venv / 'tools'}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "scripts/setup_venv.sh", str(fake_venv / "venv")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return (fake_venv / "pip.log").read_text().splitlines(), done.stderr


def _torch_installs(pip_calls: list[str]) -> list[str]:
    return [call for call in pip_calls if "torch==" in call]


def test_torch_comes_from_the_cpu_index_when_it_answers(fake_venv, tmp_path):
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<a href='torch.whl'>torch.whl</a>")
    handler = lambda *args: http.server.SimpleHTTPRequestHandler(*args, directory=str(tmp_path / "index"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        pip_calls, stderr = _setup(fake_venv, index)
    finally:
        server.shutdown()
        server.server_close()
    assert _torch_installs(pip_calls) == [f"install -q --index-url {index} --timeout 30 --retries 1 torch==2.13.0"]
    assert "did not answer" not in stderr
    assert pip_calls[-1] == "install -q -e .[test]"


def test_an_index_that_does_not_answer_falls_back_to_the_package_index(fake_venv):
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        pip_calls, stderr = _setup(fake_venv, index)
    assert _torch_installs(pip_calls) == ["install -q torch==2.13.0"]
    assert f"{index} did not answer" in stderr and "CUDA build" in stderr


def test_a_second_run_keeps_the_torch_there_is(fake_venv):
    (fake_venv / "has-torch").touch()
    pip_calls, _ = _setup(fake_venv, "http://127.0.0.1:9/never-asked")
    assert _torch_installs(pip_calls) == [] and pip_calls[-1] == "install -q -e .[test]"
