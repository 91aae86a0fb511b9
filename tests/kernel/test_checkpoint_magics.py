"""`%fsdp2 save` and `%fsdp2 load` where a user meets their failures: no checkpointer, a damaged step."""

import re

import pytest

SETUP = """%%fsdp2
from pathlib import Path
from torch.distributed.fsdp import fully_shard
from fsdp2nb.checkpoint import Checkpointer
from fsdp2nb.examples.tiny_models import make_tiny_model

model = make_tiny_model("llama", seed=0)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = Checkpointer(ckpt_dir, async_save=False).track(model=model, optimizer=optimizer)

def train_step():
    ids = torch.randint(0, 131, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()

def snapshot():
    return [p.full_tensor().clone() for p in model.parameters()]

train_step()
ckpt.save(1)
at_step1 = snapshot()
train_step()
ckpt.save(2)
train_step()
"""


def test_save_and_load_without_a_tracked_checkpointer_say_so_in_one_line(kernel):
    for line in ("%fsdp2 save", "%fsdp2 load latest"):
        run = kernel.execute(line)
        assert run.status == "error" and run.error is None  # no traceback
        assert run.stderr.count("\n") == 1, run.stderr
        assert run.stderr.startswith("UsageError: no checkpointer is tracking a model on the ranks")
        assert "Checkpointer(directory).track(model=model, optimizer=optimizer)" in run.stderr


@pytest.fixture(scope="module")
def damaged(kernel, tmp_path_factory):
    """Steps 1 and 2 saved on 2 ranks, trained on since; rank 1's shard of step 2 emptied."""
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    run = kernel.execute(f"ckpt_dir = {str(ckpt_dir)!r}\n%fsdp2 push ckpt_dir")
    assert run.status == "ok", run.stderr
    run = kernel.execute(SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    (shard,) = (ckpt_dir / "step-000002").glob("__1_*.distcp")
    shard.write_bytes(b"")
    return kernel, shard.name


def test_load_latest_skips_a_damaged_step_in_one_line_on_every_rank(damaged):
    kernel, shard = damaged
    run = kernel.execute("%fsdp2 load latest")
    assert run.status == "ok", run.traceback_text
    assert "loaded step 1" in run.stdout
    notes = [line for line in run.stderr.splitlines() if "step 2" in line]
    assert len(notes) == 1 and shard in notes[0] and "using step 1" in notes[0], run.stderr
    run = kernel.execute("%%fsdp2\nprint(all(a.equal(b) for a, b in zip(snapshot(), at_step1)))")
    assert run.stdout == "[all] True\n"


def test_loading_the_damaged_step_names_its_file_and_changes_nothing(damaged):
    kernel, shard = damaged
    kernel.execute("%%fsdp2\ntrain_step()\nbefore = snapshot()")
    run = kernel.execute("%fsdp2 load 2")
    assert run.status == "error" and run.error is None, run.traceback_text  # one line, no tracebacks
    assert re.fullmatch(rf"UsageError: step=2 has no complete checkpoint in \S+ \({shard} is 0 bytes, "
                        r"\d+ were written\); available: \[1\]\n", run.stderr), run.stderr
    run = kernel.execute("%%fsdp2\nprint(all(a.equal(b) for a, b in zip(snapshot(), before)))")
    assert run.stdout == "[all] True\n"
