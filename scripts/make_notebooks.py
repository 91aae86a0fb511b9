"""Write notebooks/*.ipynb from the cells below: kept as code so that a review sees plain diffs.

    python scripts/make_notebooks.py          # rewrite every notebook
    python scripts/make_notebooks.py --check  # exit 1 when a notebook differs from its cells here

Cells tagged with a name (the third item of a cell) are the ones `scripts/run_demo.py` and
`tests/notebooks/` read their facts from.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"

QUICKSTART = [
    ("markdown", """# fsdp2nb quickstart

Train a language model on several ranks from this notebook, look at what it writes and measure
its loss between training cells, save it, restart every rank, resume and export it, then generate
text with the export. The ranks are worker processes that form one
`torch.distributed` job: one per GPU, or two CPU ranks joined by gloo when there is no GPU.

Everything runs offline: the model is a tiny Llama-style model made from a config, and the text it
learns is a short story that ships with fsdp2nb. Run the cells from the top (or `make demo`, which
runs this notebook headless and writes the executed copy beside it)."""),
    ("code", "%load_ext fsdp2nb"),
    ("markdown", """## A model to train

`save_tiny_llama` writes a randomly initialised Llama-style model as a real Hugging Face checkpoint
(`model.safetensors`, `config.json`) with a tokenizer that gives each printable character one id.
To train a real model instead, set `model_dir` to its directory or Hub id
(`notebooks/finetune_gpu.ipynb` does that on GPUs)."""),
    ("code", """import tempfile
from pathlib import Path

from fsdp2nb.examples import save_tiny_llama

workdir = Path(tempfile.mkdtemp(prefix="fsdp2nb-quickstart-"))
model_dir = save_tiny_llama(workdir / "tiny-llama")
ckpt_dir = workdir / "checkpoints"
export_dir = workdir / "export"
print("model:", model_dir, sorted(p.name for p in model_dir.iterdir()))"""),
    ("markdown", """## Start the ranks

`%fsdp2 start` starts one rank per visible GPU, or 2 CPU ranks without one (`--cpu 4` or
`--gpus 0,1` choose). The panel below it stays live: each rank's state and memory, the training
curve, the checkpoints, with buttons to stop, save, load and export. Where widgets cannot render
(this notebook run headless) the same facts appear as text. `%fsdp2 push` sends notebook variables
to every rank."""),
    ("code", "%fsdp2 start\n%fsdp2 push model_dir ckpt_dir export_dir", "start"),
    ("markdown", """## Load the model, sharded, with LoRA adapters

From here on, a `%%fsdp2` cell runs on every rank at once; `rank`, `world_size`, `device` and
`torch` are defined there, and what a cell defines stays for the next one. `setup_training`
(in `fsdp2nb/examples`) calls `fsdp2nb.load_model` with LoRA adapters on every linear layer: each
rank reads only its own slices of the checkpoint (FSDP2 shards every weight over the ranks). It
also makes the optimizer and a `Checkpointer` that tracks model and optimizer. The resume below
calls the same function."""),
    ("code", """%%fsdp2
import fsdp2nb
from fsdp2nb.examples import sample_text, setup_training, text_batches

run = setup_training(model_dir, ckpt_dir)
model, tokenizer, optimizer, ckpt = run.model, run.tokenizer, run.optimizer, run.ckpt
trainable = [p for p in model.parameters() if p.requires_grad]
print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {sum(p.numel() for p in trainable):,} "
      f"of them trainable (LoRA), in {run.engine.config.mixed_precision}")
print(f"rank {rank} on {device} holds {sum(p.to_local().numel() for p in trainable):,} of the trainable ones")""",
     "load"),
    ("markdown", """## Look at what the model writes

`fsdp2nb.generate` spreads the prompts over the ranks: each rank generates its share as one batch
on the whole model (the weights are gathered once and sharded again afterwards) and every rank
gets all completions back, in prompt order. `fsdp2nb.evaluate` gives the mean loss per token and
the perplexity over a dataset spread the same way; with `step=` the dashboard plots it beside the
training loss. Here the examples are the story cut into windows of 64 characters: the text the
model trains on, so this measures how well it fits, not how it generalises. Untrained, it writes
noise."""),
    ("code", """%%fsdp2
from fsdp2nb.examples import text_windows

prompts = ["The light", "The keeper", "At night", "The sea"]
windows = text_windows(tokenizer, sample_text(), seq_len=64)
before = fsdp2nb.evaluate(model, windows, batch_size=8, step=0)
samples = fsdp2nb.generate(model, tokenizer, prompts, max_new_tokens=40, do_sample=False)
if rank == 0:
    print(f"before training: loss {before.loss:.3f}, perplexity {before.perplexity:.1f} "
          f"over {before.num_examples} windows")
    for prompt, completion in zip(prompts, samples):
        print(f"{prompt!r} -> {completion!r}")""", "sample_before"),
    ("markdown", """## Train

Each rank draws its own windows of the story (data parallelism) and FSDP2 averages the gradients.
`fsdp2nb.log` records the loss for the dashboard's curve (`%fsdp2 metrics` gives the table), and
`ckpt.maybe_save(step)` is where a **Save now** clicked on the dashboard during training is served.
Only rank 0 prints, so the lines come once, labelled `[0]`."""),
    ("code", """%%fsdp2
batches = text_batches(tokenizer, sample_text(), seq_len=64, batch_size=8, device=device)
for step in range(40):
    loss = model(**next(batches)).loss
    loss.backward()
    fsdp2nb.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    fsdp2nb.log(step, loss=loss.item())
    ckpt.maybe_save(step)
    if rank == 0 and (step % 10 == 0 or step == 39):
        print(f"step {step:2d}  loss {loss.item():.3f}")""", "train"),
    ("markdown", """## Sample and evaluate again

`stream=True` shows the first prompt's text as it is made, on one line (run headless, the
notebook keeps its final state). Training goes on from here unchanged: the model is sharded as
before."""),
    ("code", """%%fsdp2
after = fsdp2nb.evaluate(model, windows, batch_size=8, step=39)
samples = fsdp2nb.generate(model, tokenizer, prompts, max_new_tokens=60, do_sample=False, stream=True)
if rank == 0:
    print(f"after 40 steps: loss {after.loss:.3f} (before training {before.loss:.3f}), "
          f"perplexity {after.perplexity:.1f}")
    for prompt, completion in zip(prompts, samples):
        print(f"{prompt!r} -> {completion!r}")""", "sample_after"),
    ("markdown", """## Save

`%fsdp2 save` asks every rank's tracked checkpointer to save at the last step it saw (`ckpt.save()`
in a `%%fsdp2` cell does the same). The save is one distributed checkpoint, committed atomically;
the dashboard lists it."""),
    ("code", "%fsdp2 save", "save"),
    ("markdown", """## Restart the ranks and resume

`%fsdp2 restart` ends the rank processes and starts fresh ones: the model, the optimizer and every
variable on the ranks are gone (a crashed rank costs the same). The same set-up, then
`ckpt.load("latest")` restores model, optimizer and random state, and returns the step saved."""),
    ("code", "%fsdp2 restart\n%fsdp2 push model_dir ckpt_dir export_dir"),
    ("code", """%%fsdp2
from fsdp2nb.examples import setup_training

run = setup_training(model_dir, ckpt_dir)
resumed_step = run.ckpt.load("latest")
if rank == 0:
    print("checkpoints:", [entry.step for entry in run.ckpt.list()], "LATEST:", run.ckpt.latest())
    print(f"resumed from {ckpt_dir} at step {resumed_step}")""", "resume"),
    ("markdown", """## Export for Hugging Face

`fsdp2nb.export_hf` writes the model in Hugging Face format, gathering one tensor at a time so no
rank holds the whole model. For a LoRA model that is the adapter (`adapter_model.safetensors`,
`adapter_config.json`), which names the base model's directory."""),
    ("code", """%%fsdp2
import fsdp2nb

fsdp2nb.export_hf(run.model, export_dir, processor=run.tokenizer)
if rank == 0:
    print("exported to", export_dir, sorted(p.name for p in export_dir.iterdir()))""", "export"),
    ("markdown", """## Generate, here in the notebook

The export is an ordinary Hugging Face directory: `from_pretrained` loads it in this kernel, with no
ranks involved (peft's `AutoPeftModelForCausalLM` puts the adapter on its base model). A model of
this size, trained for 40 steps, has learned which letters the story uses and how often, and its
most frequent word: greedy decoding (the likeliest character each time) repeats that word."""),
    ("code", """from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(export_dir)
model = AutoPeftModelForCausalLM.from_pretrained(export_dir)
prompt = tokenizer("The light", return_tensors="pt")
generated = model.generate(**prompt, max_new_tokens=60, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print("generated:", tokenizer.decode(generated[0], skip_special_tokens=True))""", "generate"),
    ("markdown", """`%fsdp2 stop` ends the ranks (closing the notebook or restarting its kernel does too). Next:
`notebooks/checkpoints.ipynb` (saves from the dashboard, async saves, retention, resuming on fewer
ranks) and `notebooks/finetune_gpu.ipynb` (a Hugging Face model on GPUs)."""),
    ("code", "%fsdp2 stop"),
]

CHECKPOINTS = [
    ("markdown", """# Checkpoints

A `Checkpointer` saves model, optimizer, random state and step as one distributed checkpoint
(PyTorch DCP), committed atomically: a step directory appears whole or not at all, and `LATEST`
names the newest. This notebook saves from the dashboard while training runs, saves
asynchronously, keeps only the last few steps, resumes on fewer ranks than it saved from, and
exports for Hugging Face. It runs on 2 CPU ranks."""),
    ("code", """%load_ext fsdp2nb

import tempfile
from pathlib import Path

from fsdp2nb.examples import save_tiny_llama

workdir = Path(tempfile.mkdtemp(prefix="fsdp2nb-checkpoints-"))
model_dir = save_tiny_llama(workdir / "tiny-llama")
ckpt_dir = workdir / "checkpoints"
export_dir, merged_export_dir = workdir / "export", workdir / "export-merged\""""),
    ("code", "%fsdp2 start --cpu 2\n%fsdp2 push model_dir ckpt_dir export_dir merged_export_dir", "start"),
    ("markdown", """`keep=2` keeps the two newest steps; `async_save=True` (the default) lets training go on
while the files are written. `run.train_step(batch, step)` is one step: forward, backward, clipping,
optimizer step, `fsdp2nb.log` of the loss."""),
    ("code", """%%fsdp2
import time
from fsdp2nb.examples import sample_text, setup_training, text_batches

run = setup_training(model_dir, ckpt_dir, keep=2, async_save=True)
ckpt = run.ckpt
batches = text_batches(run.tokenizer, sample_text(), device=device)"""),
    ("markdown", """## A save clicked during training

In JupyterLab: run the next cell, then click **Save now** in the dashboard above while it runs.
The ranks cannot stop mid-step to save, so the click is served at the loop's next
`ckpt.maybe_save(step)`, on every rank at the same step; the panel says "requested", then
"saving step N", then "saved step N".

`--bg` runs the cell in the background: it returns at once, its output keeps streaming in, and
the notebook stays free for the next cell. Run headless, nobody clicks: the cell after it presses
the panel's **Save now** from code, the same request a click sends."""),
    ("code", """%%fsdp2 --bg --name training
saved_at = None
for step in range(2000):  # until 5 steps after the save; a cap, should nobody ask for one
    run.train_step(next(batches), step)
    if ckpt.maybe_save(step):
        saved_at = step
    if saved_at is not None and step >= saved_at + 5:
        break
    time.sleep(0.02)"""),
    ("code", """from fsdp2nb.examples import press_save_now

print("dashboard:", press_save_now())
%fsdp2 wait training"""),
    ("code", """%%fsdp2
ckpt.wait()
if rank == 0:
    print(f"the save asked for from the dashboard was made at step {saved_at}; training went on to step {step}")
    print("checkpoints:", [entry.step for entry in ckpt.list()])""", "dashboard_save"),
    ("markdown", """## Async saves and retention

`ckpt.save(step)` with `async_save=True` returns once each rank has copied its shards; the files
are written from a thread while training continues, and the optimizer's next step waits only
for that copy. `ckpt.blocked_s` is the time training spent waiting on saves. With `keep=2`, each
save leaves the two newest steps and removes the older ones."""),
    ("code", """%%fsdp2
for step in range(saved_at + 6, saved_at + 26):
    loss = run.train_step(next(batches), step)
    if step % 5 == 0:
        ckpt.save(step)          # returns while the files are still being written
ckpt.wait()                      # every write finished and committed
if rank == 0:
    print(f"loss {loss:.3f} at step {step}; training waited {ckpt.blocked_s:.2f} s for saves")
    print("checkpoints kept (keep=2):", [entry.step for entry in ckpt.list()], "LATEST:", ckpt.latest())""",
     "retention"),
    ("markdown", """## Resume on fewer ranks

A distributed checkpoint records every tensor whole, with where each rank's shard belongs, so it
loads on any number of ranks: here the 2 ranks' checkpoint is resumed on 1. Random number
generators are saved per rank: rank 0 gets its own back, and the cell says whose streams have no
rank to go to now."""),
    ("code", "%fsdp2 restart --cpu 1\n%fsdp2 push model_dir ckpt_dir export_dir merged_export_dir"),
    ("code", """%%fsdp2
from fsdp2nb.examples import sample_text, setup_training, text_batches

run = setup_training(model_dir, ckpt_dir, keep=2)
resumed_step = run.ckpt.load("latest")
loss = run.train_step(next(text_batches(run.tokenizer, sample_text(), device=device)), resumed_step + 1)
print(f"resumed step {resumed_step} on {world_size} rank; one more step: loss {loss:.3f}")""", "fewer_ranks"),
    ("markdown", """## Export for Hugging Face

`fsdp2nb.export_hf` writes the LoRA adapter in Hugging Face format (the dashboard's **Export HF**
does the same for the tracked model). With `merge_lora=True` it writes the adapter too, and under
`merged/` the model with the adapter merged into its weights, which `from_pretrained` loads
without peft."""),
    ("code", """%%fsdp2
import fsdp2nb

fsdp2nb.export_hf(run.model, export_dir, processor=run.tokenizer)
fsdp2nb.export_hf(run.model, merged_export_dir, merge_lora=True)
print("adapter:", sorted(p.name for p in export_dir.iterdir()))
print("merged:", sorted(p.name for p in (merged_export_dir / "merged").iterdir()))""", "export"),
    ("code", """from transformers import AutoModelForCausalLM

merged = AutoModelForCausalLM.from_pretrained(merged_export_dir / "merged")
print(f"loaded with from_pretrained: {type(merged).__name__}, {merged.num_parameters():,} parameters")"""),
    ("code", "%fsdp2 stop"),
]

FINETUNE_GPU = [
    ("markdown", """# Fine-tune a Hugging Face model on GPUs

The quickstart's story with a Hugging Face model from the Hub or a directory (Qwen/Qwen2.5-0.5B by
default): bf16 compute, LoRA first, then full fine-tuning, optionally with parameters offloaded to
CPU memory. `make gpu-check` runs it offline, on a model of Qwen2.5-0.5B's shape with random
weights made from a config: what it shows there is speed and memory, not what a model learns. The parameters below are read
from environment variables where set (`scripts/gpu_check.sh` runs this notebook that way);
change them here otherwise. `GPUS = "cpu"` runs the same cells on 2 CPU ranks, for a tiny model."""),
    ("code", """import os

MODEL = os.environ.get("FSDP2NB_MODEL", "Qwen/Qwen2.5-0.5B")  # a Hub id (hub or local cache) or a directory
GPUS = os.environ.get("FSDP2NB_GPUS", "all")   # "all", a count ("2"), a list ("0,1") or "cpu"
STEPS = int(os.environ.get("FSDP2NB_STEPS", "30"))
OFFLOAD = os.environ.get("FSDP2NB_OFFLOAD", "0") == "1"  # full fine-tuning with parameters in CPU memory
SEQ_LEN = int(os.environ.get("FSDP2NB_SEQ_LEN", "512"))
BATCH_SIZE = int(os.environ.get("FSDP2NB_BATCH_SIZE", "4"))""", "parameters"),
    ("code", """%load_ext fsdp2nb

import tempfile
from pathlib import Path

workdir = Path(tempfile.mkdtemp(prefix="fsdp2nb-finetune-"))
ckpt_dir, export_dir = workdir / "checkpoints", workdir / "export"
pool_options = {"cpu": "--cpu 2", "all": ""}.get(GPUS, f"--gpus {GPUS}")
print(f"model {MODEL}; ranks: {pool_options or 'every visible GPU'}")"""),
    ("markdown", """## Start the ranks

`--gpus 0,1` uses GPUs 0 and 1 only (any subset works: `--gpus 1,3`); `--gpus 2` the first two.
The dashboard shows each GPU's allocated, reserved and peak memory."""),
    ("code", "%fsdp2 start $pool_options\n%fsdp2 push MODEL STEPS OFFLOAD SEQ_LEN BATCH_SIZE ckpt_dir export_dir",
     "start"),
    ("markdown", """## The training loop

Defined once on the ranks: it trains whatever `model`, `optimizer` and `ckpt` name when it runs,
the LoRA model first, then the fully fine-tuned one. Each rank draws its own windows of the text
shipped with fsdp2nb; `fsdp2nb.log` feeds the dashboard's curve."""),
    ("code", """%%fsdp2
import fsdp2nb
from fsdp2nb.examples import sample_text, text_batches

def train(steps):
    seq_len = min(SEQ_LEN, len(tokenizer(sample_text()).input_ids) - 1)
    batches = text_batches(tokenizer, sample_text(), seq_len=seq_len, batch_size=BATCH_SIZE, device=device)
    for step in range(steps):
        loss = model(**next(batches)).loss
        loss.backward()
        fsdp2nb.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        fsdp2nb.log(step, loss=loss.item())
        ckpt.maybe_save(step)
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {loss.item():.3f}")
    ckpt.save(steps - 1)
    ckpt.wait()"""),
    ("markdown", """## LoRA

`fsdp2nb.load_model` takes a Hub id or a directory; each rank reads its slices of the safetensors
files. bf16 compute on GPUs (trainable parameters stored in fp32, gathered in bf16), fp32 on CPU
ranks. The base weights are frozen and kept in the compute dtype; only the adapters train."""),
    ("code", """%%fsdp2
from peft import LoraConfig

precision = "bf16" if device.type == "cuda" else "fp32"
lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
model, tokenizer = fsdp2nb.load_model(MODEL, lora=lora, engine=fsdp2nb.FSDP2Engine(mixed_precision=precision))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
ckpt = fsdp2nb.Checkpointer(ckpt_dir / "lora", keep=2).track(model=model, optimizer=optimizer)
train(STEPS)""", "lora"),
    ("code", "%fsdp2 status"),
    ("markdown", """## Full fine-tuning

Every weight trains now, so the optimizer holds two fp32 moments per parameter.
`offload_params=True` keeps parameters, gradients and optimizer state in CPU memory (the
optimizer steps on the CPU), for a model that does not fit otherwise. The LoRA model is dropped
first; `%fsdp2 restart` would free everything too, at the price of every variable on the ranks."""),
    ("code", """%%fsdp2
import gc

ckpt.close()
del model, optimizer, ckpt
gc.collect()
if device.type == "cuda":
    torch.cuda.empty_cache()
engine = fsdp2nb.FSDP2Engine(mixed_precision=precision, offload_params=OFFLOAD and device.type == "cuda")
model, tokenizer = fsdp2nb.load_model(MODEL, engine=engine)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ckpt = fsdp2nb.Checkpointer(ckpt_dir / "full", keep=2).track(model=model, optimizer=optimizer)
print(f"rank {rank} on {device}: parameters offloaded to CPU memory: {engine.config.offload_params}")
train(STEPS)""", "full"),
    ("code", """%%fsdp2
fsdp2nb.export_hf(model, export_dir, processor=tokenizer, dtype=engine.compute_dtype)
if rank == 0:
    print("exported to", export_dir, sorted(p.name for p in export_dir.iterdir()))""", "export"),
    ("markdown", "The export loads anywhere `transformers` runs; here, in this kernel, on the CPU."),
    ("code", """from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(export_dir)
model = AutoModelForCausalLM.from_pretrained(export_dir)
prompt = tokenizer("The light", return_tensors="pt")
generated = model.generate(**prompt, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print("generated:", tokenizer.decode(generated[0], skip_special_tokens=True))""", "generate"),
    ("code", "%fsdp2 stop"),
]

SFT_TRAINER = [
    ("markdown", """# TRL's SFTTrainer on sharded ranks

A model from `fsdp2nb.load_model` is already sharded with FSDP2. `fsdp2nb.trainer_for(SFTTrainer)`
(or `trainer_for(Trainer)`) gives a trainer class that trains it as it is, without wrapping it
again, and writes its checkpoints and `save_model` shard-wise: no rank gathers the whole model.
`fsdp2nb.TrainerCallback()` sends Trainer's logs to the dashboard's curve, and its Save and Stop
buttons to Trainer. Here: LoRA for a few steps, on every visible GPU with a Hub model where CUDA
is present, else on 2 CPU ranks with a tiny Llama-style model made in this notebook. The
parameters below are read from environment variables where set (`scripts/gpu_check.sh` runs
this notebook that way); change them here otherwise."""),
    ("code", """import os

from fsdp2nb.pool.spec import visible_gpu_indices  # reads /proc, initialises no CUDA in this kernel

GPUS = os.environ.get("FSDP2NB_GPUS", "all" if visible_gpu_indices() else "cpu")  # "all", "2", "0,1" or "cpu"
MODEL = os.environ.get("FSDP2NB_MODEL", "tiny" if GPUS == "cpu" else "Qwen/Qwen2.5-0.5B")  # "tiny", a Hub id or a directory
MAX_LENGTH = int(os.environ.get("FSDP2NB_SEQ_LEN", "64" if MODEL == "tiny" else "512"))""", "parameters"),
    ("code", """%load_ext fsdp2nb

import tempfile
from pathlib import Path

from fsdp2nb.examples import save_tiny_llama

workdir = Path(tempfile.mkdtemp(prefix="fsdp2nb-sft-"))
model_dir = save_tiny_llama(workdir / "tiny-llama") if MODEL == "tiny" else MODEL
out_dir, export_dir = workdir / "sft", workdir / "export"
pool_options = {"cpu": "--cpu 2", "all": ""}.get(GPUS, f"--gpus {GPUS}")
print(f"model {model_dir}; ranks: {pool_options or 'every visible GPU'}")""", "setup"),
    ("code", "%fsdp2 start $pool_options\n%fsdp2 push model_dir out_dir export_dir MAX_LENGTH", "start"),
    ("markdown", """## Train with LoRA

Every rank builds the same trainer; TRL tokenizes the `text` column. Trainer saves a checkpoint
every 4 steps: the adapter in Hugging Face format, and the adapter with its optimizer state as a
distributed checkpoint (`fsdp2nb_dcp/`), which is what a resume reads. bf16 compute on GPUs
(trainable parameters stored in fp32), fp32 on CPU ranks."""),
    ("code", """%%fsdp2
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

import fsdp2nb
from fsdp2nb.examples import sample_text

precision = "bf16" if device.type == "cuda" else "fp32"

def make_trainer(max_steps):
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model, tokenizer = fsdp2nb.load_model(model_dir, lora=lora, engine=fsdp2nb.FSDP2Engine(mixed_precision=precision))
    sentences = [s.strip() + "." for s in sample_text().split(".") if s.strip()]
    args = SFTConfig(output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=4,
                     learning_rate=5e-3, max_length=MAX_LENGTH, logging_steps=1, save_steps=4, report_to="none",
                     use_cpu=device.type == "cpu", disable_tqdm=True)
    return fsdp2nb.trainer_for(SFTTrainer)(model=model, args=args, processing_class=tokenizer,
                                           train_dataset=Dataset.from_dict({"text": sentences}),
                                           callbacks=[fsdp2nb.TrainerCallback()])

trainer = make_trainer(max_steps=8)
trainer.train()
if rank == 0:
    losses = [round(e["loss"], 3) for e in trainer.state.log_history if "loss" in e]
    print("losses:", losses)
    print("checkpoints:", sorted(p.name for p in out_dir.glob("checkpoint-*")))""", "train"),
    ("markdown", "What `fsdp2nb.TrainerCallback` logged is the dashboard's curve; `%fsdp2 metrics` gives it as a table."),
    ("code", """import math

# Each rank sends its last points before its reply: they are all here once the cell has ended.
rows = %fsdp2 metrics  # a list of dicts (rank, step, time, each logged value); a DataFrame with pandas
records = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
steps = {row["step"] for row in records if math.isfinite(row.get("loss", math.nan))}
print("steps with a loss on the dashboard:", sorted(steps))""", "metrics"),
    ("markdown", """## Save, resume

`trainer.save_model` writes the adapter (`adapter_model.safetensors`, `adapter_config.json`) and the
tokenizer. A new trainer on a freshly loaded model resumes from the latest checkpoint: the adapter,
its optimizer state, the scheduler and the data order continue from step 8."""),
    ("code", """%%fsdp2
trainer.save_model(str(export_dir))
trainer = make_trainer(max_steps=12)
trainer.train(resume_from_checkpoint=True)
if rank == 0:
    print("exported:", sorted(p.name for p in export_dir.iterdir()))
    print("resumed, now at step", trainer.state.global_step)""", "resume"),
    ("markdown", "The export is an ordinary peft adapter: it loads here, in the notebook's kernel, without ranks."),
    ("code", """from peft import AutoPeftModelForCausalLM

model = AutoPeftModelForCausalLM.from_pretrained(export_dir)
print("loaded:", type(model).__name__, "with adapter", model.active_adapter)""", "load"),
    ("code", "%fsdp2 stop"),
]

NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "checkpoints.ipynb": CHECKPOINTS, "finetune_gpu.ipynb": FINETUNE_GPU,
             "sft_trainer.ipynb": SFT_TRAINER}


def build(cells: list[tuple]) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    for index, (kind, source, *tag) in enumerate(cells):
        maker = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = maker(source, id=f"cell-{index:02d}")  # stable ids: regenerating changes nothing
        if tag:
            cell.metadata["tags"] = list(tag)
        notebook.cells.append(cell)
    return notebook


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    stale = []
    for name, cells in NOTEBOOKS.items():
        path, text = NOTEBOOKS_DIR / name, nbformat.writes(build(cells)) + "\n"
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
            continue
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/make_notebooks.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
