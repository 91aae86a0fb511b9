"""GPU figures measured side by side in one run, on one GPU (run by scripts/gpu_check.sh).

- Training throughput (tokens/s) and peak memory of a bf16 FSDP2 training loop in a `%%fsdp2`
  cell, against the same code as a plain script under torchrun, alternating; and that script's
  plain single-GPU loop without FSDP (autocast bf16) as a second reference.
- Load time of the checkpoint with the engine against `from_pretrained` onto the GPU, cold page
  cache, alternating.
- Async save: training stall per save (`Checkpointer.blocked_s`) against a synchronous save.
- `offload_params=True`: step time and peak GPU memory against no offload.
- Snapshots in host memory (`memory_every=1`): the step time with a snapshot after every step
  against without, in alternating blocks; the copy's own time per snapshot, the time training
  waited for it, and the restore's time into the same model.
- `generate` (not run by default: `--sections generate`): 8 prompts, 32 new tokens, tokens/s of
  `fsdp2nb.generate` against the same weights whole on the GPU (bf16) and against plain
  `model.generate` on the sharded model, alternating, in one cell.

The model is Qwen2-shaped, about 0.5 B parameters, made from a config (no download).
`--tiny --cpu` runs every path on CPU ranks with a tiny model, to check the script itself.
Run: python -m benchmarks.bench_gpu [--json PATH] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import traceback

from tests.support.kernel_client import Kernel

HALF_BILLION = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)

# Shared by the cell and the torchrun script (followed by TIMED): `device`, MODEL_DIR, VOCAB, BATCH, SEQ, STEPS,
# OFFLOAD are defined before it runs. Prints one RESULT line of JSON on rank 0.
TRAIN = """
import json, time, torch, fsdp2nb
on_gpu = device.type == "cuda"
sync = torch.cuda.synchronize if on_gpu else (lambda: None)
engine = fsdp2nb.FSDP2Engine(mixed_precision="bf16", offload_params=OFFLOAD)
model, _ = fsdp2nb.load_model(MODEL_DIR, engine=engine)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
def train_step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    fsdp2nb.clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""

# Times `train_step` after a warm-up; appended to TRAIN and PLAIN. Prints the RESULT on rank 0.
TIMED = """
for _ in range(WARMUP):
    train_step()
if on_gpu:
    torch.cuda.reset_peak_memory_stats()
sync(); started = time.perf_counter()
for _ in range(STEPS):
    train_step()
sync(); elapsed = time.perf_counter() - started
result = dict(tokens_per_s=STEPS * BATCH * SEQ / elapsed, step_s=elapsed / STEPS,
              peak_bytes=torch.cuda.max_memory_allocated() if on_gpu else 0,
              held_bytes=torch.cuda.memory_allocated() if on_gpu else 0)  # between steps
if not dist.is_initialized() or dist.get_rank() == 0:
    print("RESULT " + json.dumps(result))
"""

# The reference without FSDP: the model whole on the GPU, bf16 autocast, the same optimizer.
PLAIN = """
import json, time, torch
from transformers import AutoModelForCausalLM
on_gpu = device.type == "cuda"
sync = torch.cuda.synchronize if on_gpu else (lambda: None)
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
def train_step():
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
"""

TORCHRUN_PRELUDE = """
import os, torch, torch.distributed as dist
if torch.cuda.is_available() and not CPU:
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("cuda:nccl,cpu:gloo")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
"""

EVICT = """
import os, glob
def evict(directory):
    for name in glob.glob(os.path.join(directory, "*.safetensors")):
        fd = os.open(name, os.O_RDONLY)
        os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
"""

LOAD_ENGINE = EVICT + """
import time, gc, fsdp2nb
evict(MODEL_DIR); dist.barrier()
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
started = time.perf_counter()
model, _ = fsdp2nb.load_model(MODEL_DIR)  # bf16: the default engine
sync(); elapsed = time.perf_counter() - started
del model; gc.collect()
if device.type == "cuda": torch.cuda.empty_cache()
print("RESULT " + json.dumps(dict(load_s=elapsed)))
"""

LOAD_HF = EVICT + """
import time, gc
from transformers import AutoModelForCausalLM
evict(MODEL_DIR)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
started = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, device_map={"": str(device)})
sync(); elapsed = time.perf_counter() - started
del model; gc.collect()
if device.type == "cuda": torch.cuda.empty_cache()
print("RESULT " + json.dumps(dict(load_s=elapsed)))
"""

# Needs TRAIN's model, optimizer and train_step. Per round: a synchronous save's time, then an
# async save followed by steps until it is written; the stall is what training waited for it.
SAVE_STALL = """
import shutil, fsdp2nb
sync_dir, async_dir = CKPT_ROOT + "/sync", CKPT_ROOT + "/async"
sync_times, stalls, steps_under_save = [], [], []
with fsdp2nb.Checkpointer(sync_dir, keep=1, async_save=False) as sync_ckpt:
    sync_ckpt.track(model=model, optimizer=optimizer)
    for step in range(ROUNDS):
        train_step(); sync()
        started = time.perf_counter(); sync_ckpt.save(step); sync(); sync_times.append(time.perf_counter() - started)
with fsdp2nb.Checkpointer(async_dir, keep=1, async_save=True) as async_ckpt:
    async_ckpt.track(model=model, optimizer=optimizer)
    for step in range(ROUNDS + 1):  # the first save also allocates the staging buffers
        train_step(); sync()
        blocked_before = async_ckpt.blocked_s
        started = time.perf_counter()
        async_ckpt.save(step)
        train_step(); sync()  # its optimizer step waits for the staging copy
        steps_under_save.append(time.perf_counter() - started)
        async_ckpt.wait()
        stalls.append(async_ckpt.blocked_s - blocked_before)
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(dict(sync_save_s=statistics.median(sync_times), stall_s=statistics.median(stalls[1:]),
                                      first_stall_s=stalls[0], stalls_s=stalls, sync_saves_s=sync_times,
                                      save_plus_step_s=statistics.median(steps_under_save[1:]))))
shutil.rmtree(CKPT_ROOT, ignore_errors=True)
del model, optimizer, sync_ckpt, async_ckpt; gc.collect()  # a checkpointer keeps what it tracked
if device.type == "cuda": torch.cuda.empty_cache()
"""

# Needs TRAIN's model, optimizer and train_step. Alternating blocks of 6 steps without and with a
# snapshot in host memory after each step (the first of each block left out: it may pay for the
# other kind's last copy); then one restore of the newest snapshot into the same model.
SNAPSHOTS = """
import shutil, fsdp2nb
snapshots = fsdp2nb.Checkpointer(CKPT_ROOT + "/snapshots", memory_every=1).track(model=model, optimizer=optimizer)
def block(first, snapshot):
    times = []
    for step in range(first, first + 6):
        sync(); started = time.perf_counter()
        train_step()
        if snapshot: snapshots.maybe_save(step)
        sync(); times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
for _ in range(WARMUP): train_step()
snapshots.maybe_save(0); snapshots.wait()  # the first allocates and pins the slots
copied, taken, blocked = snapshots._memory.snapshots.copy_s, snapshots._memory.snapshots.num_taken, snapshots.blocked_s
pairs, step = [], 1
for _ in range(ROUNDS + 2):
    pairs.append((block(step, False), block(step + 6, True))); step += 12
snapshots.wait()
num_taken = snapshots._memory.snapshots.num_taken - taken
sync(); started = time.perf_counter()
snapshots.load("memory"); sync()
restore_s = time.perf_counter() - started
from fsdp2nb.checkpoint.snapshot_layout import live_tensors
held = sum(t.numel() * t.element_size() for t in live_tensors(model, optimizer).values())
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(dict(plain_step_s=statistics.median(p for p, _ in pairs),
                                      snapshot_step_s=statistics.median(s for _, s in pairs),
                                      ratios=[s / p for p, s in pairs],
                                      copy_s=(snapshots._memory.snapshots.copy_s - copied) / num_taken,
                                      blocked_s=(snapshots.blocked_s - blocked) / num_taken,
                                      restore_s=restore_s, snapshot_bytes=held)))
snapshots.close(); shutil.rmtree(CKPT_ROOT, ignore_errors=True)
del model, optimizer, snapshots; gc.collect()
if device.type == "cuda": torch.cuda.empty_cache()
"""

# `fsdp2nb.generate`, the model whole (bf16, no FSDP) and plain `generate` on the sharded model, in
# turn: 8 prompts, 32 tokens each. The character tokenizer skips ids past its 98 when decoding.
GENERATE = """
from transformers import AutoModelForCausalLM
from fsdp2nb.examples import char_tokenizer
on_gpu = device.type == "cuda"
sync = torch.cuda.synchronize if on_gpu else (lambda: None)
tokenizer = char_tokenizer()
model, _ = fsdp2nb.load_model(MODEL_DIR)  # bf16 compute: the default engine
whole = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).to(device).eval()
prompts = ["The light", "Once upon a time there", "A keeper", "Every night the lamp", "Stairs", "Far out at sea",
           "The ships saw it and", "Rain"]
settings = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=tokenizer.pad_token_id)
inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
ways = {"fsdp2nb": lambda: fsdp2nb.generate(model, tokenizer, prompts, **settings),
        "whole": lambda: whole.generate(**inputs, **settings),
        "plain": lambda: model.generate(**inputs, **settings)}
def timed(way):
    sync(); started = time.perf_counter()
    ways[way]()
    sync(); return time.perf_counter() - started
for way in ways:
    timed(way)  # untimed: the first call builds caches
times = {way: [] for way in ways}
for _ in range(ROUNDS + 1):
    for way in ways:
        times[way].append(timed(way))
if dist.get_rank() == 0:
    print("RESULT " + json.dumps({f"generate_{way}_s": seconds for way, seconds in times.items()}))
del model, whole; gc.collect()
if on_gpu: torch.cuda.empty_cache()
"""


def _result(stdout: str) -> dict:
    found = re.findall(r"RESULT (\{.*\})", stdout)  # the last: a cell may print one per part
    assert found, f"no RESULT line in output:\n{stdout[-2000:]}"
    return json.loads(found[-1])


def _constants(model_dir: str, args: argparse.Namespace, offload: bool = False) -> str:
    dims = TINY if args.tiny else HALF_BILLION
    return (f"MODEL_DIR = {model_dir!r}\nVOCAB = {dims['vocab_size']}\nBATCH = {args.batch}\nSEQ = {args.seq}\n"
            f"STEPS = {args.steps}\nWARMUP = 3\nOFFLOAD = {offload}\nROUNDS = {args.rounds}\n"
            f"CPU = {args.cpu}\nimport json, statistics, gc, time\n")


def in_cell(kernel: Kernel, code: str) -> dict:
    run = kernel.execute("%%fsdp2\n" + code, timeout=900)
    assert run.status == "ok", run.traceback_text or run.stderr
    return _result(run.stdout)


def under_torchrun(code: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(code)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", handle.name]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=900)
    os.unlink(handle.name)
    assert done.returncode == 0, done.stderr[-3000:]
    return _result(done.stdout)


def make_checkpoint(kernel: Kernel, model_dir: str, tiny: bool) -> None:
    dims = TINY if tiny else HALF_BILLION
    code = ("from fsdp2nb.examples.tiny_models import save_tiny_checkpoint\n"
            f"if rank == 0: save_tiny_checkpoint({model_dir!r}, 'qwen2', tie_word_embeddings=True, "
            f"with_tokenizer=False, **{dims!r})\ndist.barrier()\nprint('RESULT {{}}')")
    in_cell(kernel, code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each comparison")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per run")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (to check the script)")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (to check the script without a GPU)")
    parser.add_argument("--sections", default="load,train,save,offload",
                        help="comma-separated subset of load, train, save, offload, generate")
    args = parser.parse_args()
    if not args.cpu and not _has_cuda():
        print("bench_gpu: no CUDA GPU here; skipped (--tiny --cpu runs it on CPU ranks to check the script)")
        return
    root = tempfile.mkdtemp(prefix="bench_gpu_")
    model_dir = os.path.join(root, "model")
    kernel = Kernel()
    results: dict[str, object] = {}
    chosen = args.sections.split(",")
    sections = [fn for name, fn in SECTIONS.items() if name in chosen and not (name == "offload" and args.cpu)]
    try:
        kernel.execute("%load_ext fsdp2nb")
        start = kernel.execute("%fsdp2 start --cpu 1" if args.cpu else "%fsdp2 start --gpus 1", timeout=300)
        assert start.status == "ok", start.stderr
        make_checkpoint(kernel, model_dir, args.tiny)
        for section in sections:  # one failing section must not cost the others' figures
            try:
                results.update(section(kernel, model_dir, root, args))
            except Exception:
                results.setdefault("errors", {})[section.__name__] = traceback.format_exc()[-3000:]
                print(f"{section.__name__} failed:\n{results['errors'][section.__name__]}", flush=True)
    finally:
        kernel.stop()
        subprocess.run(["rm", "-rf", root])
    _report(results, args)


def _compare_loads(kernel: Kernel, model_dir: str, _root: str, args: argparse.Namespace) -> dict:
    engine, hf = [], []
    for _ in range(args.rounds):
        engine.append(in_cell(kernel, _constants(model_dir, args) + LOAD_ENGINE)["load_s"])
        hf.append(in_cell(kernel, _constants(model_dir, args) + LOAD_HF)["load_s"])
    return dict(load_engine_s=engine, load_from_pretrained_s=hf)


def _compare_training(kernel: Kernel, model_dir: str, _root: str, args: argparse.Namespace) -> dict:
    cell, script, plain = [], [], []
    prelude = f"CPU = {args.cpu}\n" + TORCHRUN_PRELUDE + _constants(model_dir, args)
    for _ in range(args.rounds):
        cell.append(in_cell(kernel, _constants(model_dir, args) + TRAIN + TIMED + "del model, optimizer; gc.collect()\n"
                            "if on_gpu: torch.cuda.empty_cache()\n"))
        script.append(under_torchrun(prelude + TRAIN + TIMED))
        plain.append(under_torchrun(prelude + PLAIN + TIMED))
    return dict(train_cell=cell, train_torchrun=script, train_plain=plain)


def _save_stall(kernel: Kernel, model_dir: str, root: str, args: argparse.Namespace) -> dict:
    code = _constants(model_dir, args) + f"CKPT_ROOT = {os.path.join(root, 'ckpt')!r}\n" + TRAIN + TIMED + SAVE_STALL
    return dict(save=in_cell(kernel, code))


def _offload(kernel: Kernel, model_dir: str, _root: str, args: argparse.Namespace) -> dict:
    runs = {}
    for offload in (True, False):
        code = (_constants(model_dir, args, offload=offload).replace(f"STEPS = {args.steps}", "STEPS = 4")
                + TRAIN + TIMED + "del model, optimizer; gc.collect(); torch.cuda.empty_cache()\n")
        runs["train_offload" if offload else "train_offload_baseline"] = in_cell(kernel, code)
    return runs


def _snapshots(kernel: Kernel, model_dir: str, root: str, args: argparse.Namespace) -> dict:
    code = _constants(model_dir, args) + f"CKPT_ROOT = {os.path.join(root, 'ckpt')!r}\n" + TRAIN + SNAPSHOTS
    return dict(snapshots=in_cell(kernel, code))


def _generate(kernel: Kernel, model_dir: str, _root: str, args: argparse.Namespace) -> dict:
    return in_cell(kernel, _constants(model_dir, args) + "import torch, fsdp2nb\n" + GENERATE)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


SECTIONS = {"load": _compare_loads, "train": _compare_training, "save": _save_stall, "offload": _offload,
            "snapshots": _snapshots, "generate": _generate}


def _report(results: dict, args: argparse.Namespace) -> None:
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    rows = [row for make_rows in (_training_rows, _load_row, _save_row, _offload_row, _snapshot_row, _generate_row)
            for row in _try_row(make_rows, results)]
    for name, error in results.get("errors", {}).items():
        rows.append((f"{name} FAILED", error.strip().splitlines()[-1], ""))
    width = max(len(name) for name, *_ in rows)
    for name, value, ratio in rows:
        print(f"{name:<{width}}  {value}  {ratio}")


def _try_row(make_row, results: dict) -> list[tuple[str, str, str]]:
    try:
        return make_row(results)
    except KeyError:  # that section failed; its error is listed
        return []


GIB = 2**30


def _training_rows(results: dict) -> list[tuple[str, str, str]]:
    median = statistics.median
    cell = median(r["tokens_per_s"] for r in results["train_cell"])
    script = median(r["tokens_per_s"] for r in results["train_torchrun"])
    plain = median(r["tokens_per_s"] for r in results["train_plain"])
    ratios = [c["tokens_per_s"] / s["tokens_per_s"] for c, s in zip(results["train_cell"], results["train_torchrun"], strict=True)]
    peaks = [results[k][0]["peak_bytes"] / GIB for k in ("train_cell", "train_torchrun", "train_plain")]
    return [
        ("tokens/s, %%fsdp2 cell vs the same loop under torchrun", f"{cell:,.0f} vs {script:,.0f}",
         f"{cell / script:.3f}x (paired: {', '.join(f'{r:.3f}' for r in ratios)})"),
        ("tokens/s, FSDP2 engine (1 rank) vs plain loop without FSDP", f"{script:,.0f} vs {plain:,.0f}",
         f"{script / plain:.3f}x"),
        ("peak GPU memory, cell vs torchrun vs plain", " vs ".join(f"{p:.2f}" for p in peaks) + " GiB", ""),
    ]


def _load_row(results: dict) -> list[tuple[str, str, str]]:
    engine, hf = (statistics.median(results[k]) for k in ("load_engine_s", "load_from_pretrained_s"))
    return [("load, engine vs from_pretrained onto the device (cold cache)", f"{engine:.2f} s vs {hf:.2f} s",
             f"{engine / hf:.2f}x")]


def _save_row(results: dict) -> list[tuple[str, str, str]]:
    save = results["save"]
    return [("async save stall vs synchronous save (first save, allocating buffers)",
             f"{save['stall_s']:.3f} s vs {save['sync_save_s']:.2f} s ({save['first_stall_s']:.2f} s)",
             f"{save['stall_s'] / save['sync_save_s']:.1%}")]


def _offload_row(results: dict) -> list[tuple[str, str, str]]:
    off = results["train_offload"]
    on = results["train_cell"][0] if "train_cell" in results else results["train_offload_baseline"]
    return [("offload_params vs not: step time; GPU memory peak; held between steps",
             f"{off['step_s']:.2f} s vs {on['step_s']:.3f} s; {off['peak_bytes'] / GIB:.2f} vs "
             f"{on['peak_bytes'] / GIB:.2f} GiB; {off['held_bytes'] / GIB:.2f} vs {on['held_bytes'] / GIB:.2f} GiB",
             f"{off['step_s'] / on['step_s']:.1f}x time")]


def _snapshot_row(results: dict) -> list[tuple[str, str, str]]:
    snap = results["snapshots"]
    return [("step with a snapshot in memory every step vs without; copy, waited, restore per snapshot",
             f"{snap['snapshot_step_s']:.3f} s vs {snap['plain_step_s']:.3f} s; {snap['copy_s']:.3f}, "
             f"{snap['blocked_s']:.3f}, {snap['restore_s']:.3f} s for {snap['snapshot_bytes'] / GIB:.2f} GiB",
             f"{statistics.median(snap['ratios']):.2f}x (paired: {', '.join(f'{r:.2f}' for r in snap['ratios'])})")]


def _generate_row(results: dict) -> list[tuple[str, str, str]]:
    tokens = 8 * 32
    rate = {way: [tokens / s for s in results[f"generate_{way}_s"]] for way in ("fsdp2nb", "whole", "plain")}
    median = {way: statistics.median(values) for way, values in rate.items()}
    return [("tokens/s, fsdp2nb.generate vs the model whole vs plain generate sharded (8 x 32 tokens)",
             " vs ".join(f"{median[way]:,.0f}" for way in ("fsdp2nb", "whole", "plain")),
             f"{median['fsdp2nb'] / median['whole']:.2f}x whole, {median['fsdp2nb'] / median['plain']:.1f}x plain")]


if __name__ == "__main__":
    main()
