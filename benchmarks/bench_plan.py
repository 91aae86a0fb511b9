"""`fsdp2nb.plan_memory` of a 70B-parameter Llama config for 8 GPUs: how long it takes, reading no weights.

The model directory holds config.json only (Llama 3 70B's dimensions), so no weight can be read.
Each run is a fresh process, as a notebook's first `%fsdp2 plan` is: it times the imports
(torch, transformers, the planner), the first plan (which also imports the model's code) and
then repeated plans (median), full fine-tuning and LoRA r=16 with activation checkpointing.
Run: .venv/bin/python -m benchmarks.bench_plan [--runs 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LLAMA_70B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192,
    intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
WORLD_SIZE = 8
CAPACITY = 80 * 2**30


def child(directory: str, repeats: int) -> dict:
    """One fresh process's timings, in seconds."""
    start = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from fsdp2nb.engine.memory_plan import plan_memory
    imported = time.perf_counter()
    plan = plan_memory(directory, WORLD_SIZE, capacity_bytes=CAPACITY)
    first = time.perf_counter()
    full, lora = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan_memory(directory, WORLD_SIZE, capacity_bytes=CAPACITY)
        t1 = time.perf_counter()
        lora_plan = plan_memory(directory, WORLD_SIZE, capacity_bytes=CAPACITY, lora=16, activation_checkpointing=True)
        full.append(t1 - t0)
        lora.append(time.perf_counter() - t1)
    return dict(imports=imported - start, first=first - imported, full=statistics.median(full),
                lora=statistics.median(lora), files=sorted(os.listdir(directory)),
                total=plan.device_bytes(0), lora_total=lora_plan.device_bytes(0), verdict=plan.verdict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes")
    parser.add_argument("--repeats", type=int, default=5, help="plans per process after the first")
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as directory:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(LLAMA_70B, f)
        runs = [json.loads(subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_plan", "--child", directory, "--repeats", str(args.repeats)],
            cwd=root, check=True, capture_output=True, text=True).stdout.splitlines()[-1]) for _ in range(args.runs)]
    gib = 2**30
    print(f"plan of Llama 70B (config.json only: {runs[0]['files']}) for {WORLD_SIZE} GPUs of 80 GiB, "
          f"{args.runs} fresh processes")
    for key, label in (("imports", "import torch, transformers, the planner"),
                       ("first", "first plan in the process (imports the model's code)"),
                       ("full", f"plan again, full fine-tuning (median of {args.repeats})"),
                       ("lora", f"plan again, LoRA r=16 + checkpointing (median of {args.repeats})")):
        values = [run[key] for run in runs]
        print(f"  {label:<62} median {statistics.median(values):.2f} s  (min {min(values):.2f}, max {max(values):.2f})")
    print(f"  full fine-tuning needs {runs[0]['total'] / gib:.1f} GiB per rank; "
          f"LoRA r=16 with checkpointing {runs[0]['lora_total'] / gib:.1f} GiB")
    print(f"  verdict: {runs[0]['verdict']}")


if __name__ == "__main__":
    main()
