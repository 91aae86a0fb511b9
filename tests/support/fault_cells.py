"""The notebook the fault campaign trains: a small MLP sharded with `fully_shard` on CPU ranks,
saved with an async Checkpointer that also keeps a snapshot of every step in host memory
(`memory_every=1`), its data seeded per step so that a resumed run is bitwise equal to one
without faults. Each cell is a `str.format` template (the campaign fills in the sizes)."""

WIDTH, DEPTH, BATCH = 192, 4, 16
"""The MLP's width and number of hidden blocks, and the rows of each step's batch."""
SAVE_EVERY = 3
"""A training cell saves at every step divisible by this (and `maybe_save`s at the others)."""
CHUNK = 9
"""Steps per training cell; a fault strikes inside one."""
PACE_S = 0.1
"""Seconds each step sleeps: output reaches the driver a little late, and a fault meant for the
middle of a cell must not land after its end."""

SETUP_CELL = """%%fsdp2
import hashlib, os, signal, time
import fsdp2nb
from torch import nn
from torch.distributed.fsdp import fully_shard
if "ckpt" in globals():  # a pool that survived the fault: release the old checkpointer's save
    try:
        ckpt.close()
    except Exception as error:
        print("the previous checkpointer's save failed:", type(error).__name__)
torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear({width}, {width}), nn.Tanh()) for _ in range({depth})],
                      nn.Linear({width}, 1))
for block in model[:-1]:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = fsdp2nb.Checkpointer({ckpt_dir!r}, keep=3, async_save=True, memory_every=1).track(
    model=model, optimizer=optimizer)

fault_armed = False  # set only while a cell of the campaign runs: a user's code raises, not the idle rank

def _injected_fault(signum, frame):
    if fault_armed:
        raise RuntimeError(f"injected fault on rank {{rank}}")

signal.signal(signal.SIGUSR1, _injected_fault)

def train_step(step):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # the data depend on the step only
    x = torch.randn({batch}, {width}, generator=generator)          # [batch, width]
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).tanh())
    loss.backward()
    fsdp2nb.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
    fsdp2nb.log(step, loss=loss.item())
    time.sleep({pace_s})  # paces the loop like a bigger model's step, so faults land inside it

def state_digest():
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    digests = []
    for tree in (get_model_state_dict(model, options=options),
                 get_optimizer_state_dict(model, optimizer, options=options)):
        digest = hashlib.sha256()
        _hash_into(digest, tree)
        digests.append(digest.hexdigest()[:16])
    return digests

def _hash_into(digest, value):
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(str(key).encode())
            _hash_into(digest, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _hash_into(digest, item)
    elif isinstance(value, torch.Tensor):
        digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    else:
        digest.update(repr(value).encode())
"""

TRAIN_CELL = """%%fsdp2
fault_armed = True
try:
    for step in range({first}, {end}):
        train_step(step)
        if rank == 0:
            print(f"step {{step}}", flush=True)
        if step % {save_every} == 0:
            ckpt.save(step)
            if rank == 0:
                print(f"saving {{step}}", flush=True)
        ckpt.maybe_save(step)  # the snapshot in memory, and a save asked for from the notebook
    ckpt.wait()
finally:
    fault_armed = False
"""

ARMED_LOAD_CELL = """%%fsdp2
fault_armed = True
try:
    loaded = ckpt.load("latest")
finally:
    fault_armed = False
if rank == 0:
    print(f"loaded step {loaded}")
"""
"""What a user's own cell does to resume; the exception fault strikes here rather than in the magic."""

PROBE_CELL = """%%fsdp2
probe = torch.ones(1)
dist.all_reduce(probe)
if rank == 0:
    print(f"sum {probe.item():g}")
"""

DIGEST_CELL = """%%fsdp2
digests = state_digest()
if rank == 0:
    print("digest", *digests)
"""
