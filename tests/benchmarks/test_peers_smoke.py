"""benchmarks/peers.py run once, with one repetition, so that it cannot rot.

fsdp2nb alone runs in the project's own environment on every test run: the peers are reported
as not installed there, which exercises the path that reports a failed peer. The peers run only
where `make bench-peers` has made .venv-peers: installing five tools (JupyterLab, Monarch, ...)
takes minutes, which CI's normal run does not have, so this test installs nothing.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from benchmarks import peers
from benchmarks.peer_drivers import DRIVERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEERS_PYTHON = os.path.join(ROOT, ".venv-peers", "bin", "python")
ONCE = ["--runs", "1", "--budget-s", "0", "--train-runs", "1", "--ranks", "2", "--cell-timeout", "90"]
TWO_RANK_ROWS = [key for key, *_ in peers.ROWS if "4 ranks" not in key]


def test_a_failed_peer_shows_as_failed_with_its_error_never_a_number():
    ours = peers.PeerResult("fsdp2nb", values={"output": 2.0})
    theirs = peers.PeerResult("other", values={"output": 4.0, "training": 1.0}, errors={"training": "Boom: x"})
    table = peers.markdown_table([ours, theirs], notes=[])
    output_row = next(line for line in table.splitlines() if line.startswith("| 10 MB"))
    training_row = next(line for line in table.splitlines() if line.startswith("| 20 training"))
    assert "4.00 (2.0x)" in output_row
    assert training_row.endswith("| - | failed |") and "1.0" not in training_row
    assert "- other, training: Boom: x" in table


def test_an_updated_display_replaces_the_display_it_names():
    run = peers.CellRun(status="ok", messages=[
        {"msg_type": "display_data", "content": {"data": {"text/plain": "a"}, "transient": {"display_id": "d"}}},
        {"msg_type": "stream", "content": {"name": "stdout", "text": "s"}},
        {"msg_type": "update_display_data", "content": {"data": {"text/plain": "ab"}, "transient": {"display_id": "d"}}},
    ])
    assert peers.run_text(run) == "abs"


@pytest.mark.timeout(600)
def test_fsdp2nb_alone_gives_a_number_on_every_row(tmp_path):
    results = peers.main([*ONCE, "--peers", "none", "--markdown", str(tmp_path / "peers.md")])
    assert [r.name for r in results] == ["fsdp2nb"]
    assert not results[0].errors, results[0].errors
    assert set(TWO_RANK_ROWS) <= set(results[0].values)
    assert "| fsdp2nb |" in (tmp_path / "peers.md").read_text()


@pytest.mark.timeout(1800)
def test_every_installed_peer_gives_a_number_or_an_error_on_every_row(tmp_path):
    if not os.path.exists(PEERS_PYTHON):
        reason = ".venv-peers is absent: `make bench-peers` (or scripts/setup_peers_venv.sh) makes it"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    raw = tmp_path / "peers.json"
    subprocess.run([PEERS_PYTHON, "-m", "benchmarks.peers", *ONCE, "--json", str(raw)], cwd=ROOT, check=True,
                   capture_output=True, timeout=1700)
    results = {r["name"]: r for r in json.loads(raw.read_text())}
    assert list(results) == [d.name for d in DRIVERS]
    assert not results["fsdp2nb"]["errors"], results["fsdp2nb"]["errors"]
    for name, result in results.items():
        for row in TWO_RANK_ROWS:
            assert (row in result["values"]) != (row in result["errors"]), (name, row)
