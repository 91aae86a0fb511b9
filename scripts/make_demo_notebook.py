"""Write notebooks/demo.ipynb from the cells below (kept as code so reviews see plain diffs)."""

from pathlib import Path

import nbformat

# The same set-up runs before and after the pool restart: rank state does not survive it.
SETUP = """%%fsdp2
import os
import fsdp2nb
from fsdp2nb.testing import save_tiny_checkpoint
if rank == 0 and not os.path.exists(os.path.join(model_dir, "config.json")):
    save_tiny_checkpoint(model_dir, "llama")
dist.barrier()
precision = "bf16" if device.type == "cuda" else "fp32"
model, tokenizer = fsdp2nb.load_model(model_dir, mixed_precision=precision)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
ckpt = fsdp2nb.Checkpointer(ckpt_dir, keep=2).track(model=model, optimizer=optimizer)
text = "the quick brown fox jumps over the lazy dog. " * 8

def train(steps, start=0):
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :48].to(device)
    for step in range(start, start + steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = fsdp2nb.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        ckpt.maybe_save(step)      # a Save asked for from the notebook happens here, on every rank
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm {norm:.3f}")
    return start + steps
"""

CELLS = [
    ("markdown", """# fsdp2nb demo

Train a model on several ranks from this notebook. Without a GPU the ranks run on the CPU (gloo)
and the model is a tiny Llama-style checkpoint made on the spot, so the demo needs no network.
Set `FSDP2NB_DEMO_MODEL` to a local Hugging Face model directory to use a real one."""),
    ("code", "%load_ext fsdp2nb"),
    ("code", """import os, tempfile
workdir = tempfile.mkdtemp(prefix="fsdp2nb-demo-")
model_dir = os.environ.get("FSDP2NB_DEMO_MODEL") or os.path.join(workdir, "tiny-llama")
ckpt_dir = os.path.join(workdir, "checkpoints")
print("model:", model_dir)
print("checkpoints:", ckpt_dir)"""),
    ("markdown", "Start the pool: every visible GPU, or 2 CPU ranks when there is none."),
    ("code", "%fsdp2 start\n%fsdp2 push model_dir ckpt_dir"),
    ("code", """%%fsdp2
# Every rank runs this cell. rank, world_size, device and mesh are predefined.
x = torch.ones(1, device=device) * (rank + 1)
dist.all_reduce(x)
print(f"rank {rank}/{world_size} on {device}: all_reduce -> {x.item():g}")
print("this line is the same on every rank, so it is shown once")"""),
    ("markdown", "Load the model sharded with FSDP2: each rank reads only its own slices of the checkpoint."),
    ("code", SETUP + """
print(sum(p.numel() for p in model.parameters()), "parameters, sharded over", world_size, "ranks")"""),
    ("code", "%%fsdp2\nnext_step = train(30)"),
    ("code", "%fsdp2 status"),
    ("markdown", "Save a checkpoint, restart the pool (all rank state is gone), then resume from it."),
    ("code", "%fsdp2 save"),
    ("code", "%fsdp2 restart\n%fsdp2 push model_dir ckpt_dir"),
    ("code", SETUP + """
next_step = ckpt.load("latest") + 1
if rank == 0:
    print("resumed at step", next_step)"""),
    ("code", "%%fsdp2\nnext_step = train(10, next_step)"),
    ("markdown", "Bring a sharded weight back to the notebook: a DTensor arrives as its full tensor."),
    ("code", """%%fsdp2
embedding = model.get_input_embeddings().weight
print("local shard", tuple(embedding.to_local().shape))"""),
    ("code", """embedding = %fsdp2 pull embedding
print("full tensor in the notebook:", tuple(embedding.shape))"""),
    ("code", "%fsdp2 stop"),
]


def build() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in CELLS:
        maker = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        notebook.cells.append(maker(source))
    return notebook


if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "notebooks" / "demo.ipynb"
    nbformat.write(build(), path)
    print(f"wrote {path}")
