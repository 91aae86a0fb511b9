"""JupyterLab on 127.0.0.1 with a token and fresh settings, driven by Debian's Chromium.

Playwright never downloads a browser here: it launches /usr/bin/chromium (`make test` installs
the apt package when missing). Without it these tests are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("FSDP2NB_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(os.environ.get("FSDP2NB_SHOTS", "/tmp/dash-shots"))
_RUNNING: list[Lab] = []
"""The servers started so far: their kernels end with each test (see _kernels_end_with_their_test)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Lab:
    """A running JupyterLab (or, with app="notebook", Notebook 7) server; `url(path)` opens a
    notebook with the token. Started as `sys.executable -m ...`: the venv's `jupyter` script may
    carry another venv's interpreter in its shebang, and then the kernel runs that venv's fsdp2nb."""

    def __init__(self, root: Path, fresh: Path, app: str = "lab") -> None:
        self.root, self.port, self.token, self.app = root, _free_port(), secrets.token_hex(16), app
        module, config = ("jupyterlab", "LabApp") if app == "lab" else ("notebook", "JupyterNotebookApp")
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
             f"--{config}.workspaces_dir={fresh / 'workspaces'}", f"--{config}.user_settings_dir={fresh / 'settings'}"],
            stdout=open(fresh / "lab.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "JUPYTER_CONFIG_DIR": str(fresh / "config")},
        )
        self._wait_ready(fresh / "lab.log")
        _RUNNING.append(self)

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/status?token={self.token}", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"jupyter lab did not answer within 60 s: {log.read_text()[-2000:]}")

    def url(self, path: str) -> str:
        # A workspace per notebook: Lab would otherwise reopen the notebooks of earlier tests
        # in hidden tabs, each with a dashboard of its own.
        where = f"lab/workspaces/{Path(path).stem}/tree" if self.app == "lab" else "notebooks"
        return f"http://127.0.0.1:{self.port}/{where}/{path}?token={self.token}"

    def shut_down_kernels(self) -> None:
        """End every kernel, and so its pool: an idle pool left behind takes cores from the tests after it."""
        for kernel in json.load(self._api("GET", "kernels")):
            self._api("DELETE", f"kernels/{kernel['id']}").read()

    def _api(self, method: str, path: str):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        return urllib.request.urlopen(request, timeout=60)

    def stop(self) -> None:
        _RUNNING.remove(self)
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass


def _quiet_settings(settings: Path) -> None:
    """No news toast: it would cover the dashboard in the screenshots."""
    plugin = settings / "@jupyterlab" / "apputils-extension"
    plugin.mkdir(parents=True)
    (plugin / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')


@pytest.fixture(autouse=True)
def _kernels_end_with_their_test():
    yield
    for server in _RUNNING:
        server.shut_down_kernels()


@pytest.fixture(scope="package")
def lab(tmp_path_factory):
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it as root)")
    pytest.importorskip("playwright", reason="pip install playwright (the test extras)")
    root = tmp_path_factory.mktemp("lab-root")
    fresh = tmp_path_factory.mktemp("lab-fresh")
    _quiet_settings(fresh / "settings")
    server = Lab(root, fresh)
    yield server
    server.stop()


@pytest.fixture(scope="package")
def notebook7(tmp_path_factory):
    """A Notebook 7 server (`python -m notebook`), same options as Lab."""
    if not shutil.which(CHROMIUM) and not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it as root)")
    pytest.importorskip("playwright", reason="pip install playwright (the test extras)")
    pytest.importorskip("notebook", reason="pip install notebook (the test extras)")
    root = tmp_path_factory.mktemp("nb7-root")
    fresh = tmp_path_factory.mktemp("nb7-fresh")
    _quiet_settings(fresh / "settings")
    server = Lab(root, fresh, app="notebook")
    yield server
    server.stop()


@pytest.fixture(scope="package")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"])
        yield chromium
        chromium.close()


@pytest.fixture
def shots() -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS
