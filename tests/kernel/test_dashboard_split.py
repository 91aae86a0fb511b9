"""Through a real kernel: while a training cell runs, the dashboard's snapshots split what each
rank holds into parameters, gradients and optimizer state, not "0 B" until the cell ends.

The model is built and tracked in one cell without a step, so the reading between cells has no
gradients or optimizer state; the training cell runs in the background until the notebook has
seen both in snapshots of busy ranks, then creates a flag that ends it."""

from __future__ import annotations

import json

import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel

SETUP = """%%fsdp2
import fsdp2nb
from torch.distributed.fsdp import fully_shard
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = fsdp2nb.Checkpointer(ckpt_dir).track(model=model, optimizer=optimizer)
"""

# The ranks agree on when to stop: one that saw the flag a step before another would leave that
# one alone in the step's collectives.
TRAIN_UNTIL_FLAG = """%%fsdp2 --bg --name training
import os, time
deadline = time.monotonic() + 180

def flag_seen_by_any_rank():
    seen = torch.tensor([float(os.path.exists(flag) or time.monotonic() > deadline)])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())

step = 0
while not flag_seen_by_any_rank():
    model(torch.randn(8, 64)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    step += 1
stopped_by_deadline = not os.path.exists(flag)
"""

SPLIT_SEEN_MID_CELL = """
import json, time, fsdp2nb
def _split():
    return {rank: dict(busy=s.busy, params=s.param_bytes, grads=s.grad_bytes, optimizer=s.optimizer_bytes)
            for rank, s in fsdp2nb._session.dashboard.model.snapshots.items()}
_first, _deadline = _split(), time.monotonic() + 120
while time.monotonic() < _deadline:
    _now = _split()
    if len(_now) == 2 and all(r["busy"] and r["grads"] > 0 and r["optimizer"] > 0 for r in _now.values()):
        break
    time.sleep(0.05)
open(flag, "w").close()
print(json.dumps(dict(first=_first, seen=_now)))
"""


@pytest.fixture
def kernel(tmp_path):
    kernel = Kernel(env=WITHOUT_GPUS)
    yield kernel
    kernel.stop()


def test_snapshots_split_gradients_and_optimizer_state_while_a_training_cell_runs(kernel, tmp_path):
    assert kernel.execute(f"%load_ext fsdp2nb\nckpt_dir = {str(tmp_path / 'ckpt')!r}\n"
                          f"flag = {str(tmp_path / 'flag')!r}").status == "ok"
    assert kernel.execute("%fsdp2 start --cpu 2").status == "ok"
    assert kernel.execute("%fsdp2 push ckpt_dir flag").status == "ok"
    setup = kernel.execute(SETUP)
    assert setup.status == "ok", setup.traceback_text
    started = kernel.execute(TRAIN_UNTIL_FLAG)
    assert started.status == "ok", started.traceback_text
    watched = kernel.execute(SPLIT_SEEN_MID_CELL, timeout=180)
    assert watched.status == "ok", watched.traceback_text
    readings = json.loads(watched.stdout.strip().splitlines()[-1])
    assert kernel.execute("%fsdp2 wait training", timeout=180).status == "ok"
    ended = kernel.execute("%%fsdp2\nprint('ended by the flag' if os.path.exists(flag) and not stopped_by_deadline else '?')")
    assert "[all] ended by the flag" in ended.stdout, ended.stdout + ended.traceback_text
    for rank in ("0", "1"):
        assert readings["first"][rank]["grads"] == 0 and readings["first"][rank]["optimizer"] == 0  # no step yet
        seen = readings["seen"][rank]
        assert seen["busy"], readings  # read while the cell ran, not after it
        assert seen["params"] > 0 and seen["grads"] > 0, readings
        # AdamW's two moments per trainable value (the parameters' count includes FSDP2's padding)
        assert seen["optimizer"] > 1.5 * seen["grads"], readings
