"""Tokens per second of `fsdp2nb.generate` on CPU ranks against the same weights whole in one
process, and against a plain `model.generate` on the sharded model; `fsdp2nb.evaluate` against a
plain loop in one process.

`generate`: 8 prompts, 32 new tokens each (greedy, `min_new_tokens` so every run makes as many),
Llama-style models of 4 M parameters ("tiny": a step is mostly Python overhead) and 31 M ("small":
the matrix products count), fp32. Three ways, alternating round by round:
  * whole: this process loads the checkpoint with `from_pretrained` and generates the 8 prompts as
    one left-padded batch, with torch's threads over every core or with one thread, whichever was
    faster at the start (on a machine shared with other work torch's threads can wait for each
    other far longer than they save); the same choice for evaluate;
  * fsdp2nb: `fsdp2nb.generate` in a `%%fsdp2` cell: the 8 prompts, one batch, decoded by one rank
    on every core from the model gathered once into the host's shared memory;
  * plain sharded: `model.generate` on every rank of the sharded model, each rank all 8 prompts,
    as a user would call it without `fsdp2nb.generate`: every token all-gathers every unit.
`many`: 64 prompts, at most 16 decoded at once: the whole model decodes 4 batches one after the
other; `fsdp2nb.generate(..., batch_size=16)` spreads them over the ranks that decode (goal: at least 1x).
`evaluate`: 32 examples of 64 tokens, batches of 8: `fsdp2nb.evaluate` in the cell against this
process summing the cross-entropy batch by batch with the model whole.
The cell's figure is rank 0's wall time from a barrier to the call's return. Per comparison: the medians, the
best runs (the least disturbed by other work), and the median of the paired ratios (the runs of
one round are next to each other, so drift of a shared machine hits both).
Run: .venv/bin/python -m benchmarks.bench_generate [--rounds 5] [--ranks 2 4] [--sizes tiny small]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_trainer import load_average
from tests.support.kernel_client import WITHOUT_GPUS, Kernel

NUM_NEW_TOKENS = 32
PROMPTS = ["The light", "Once upon a time there", "A keeper", "Every night the lamp", "Stairs", "Far out at sea",
           "The ships saw it and", "Rain"]
MANY_PROMPTS, MANY_BATCH = PROMPTS * 8, 16  # more prompts than one rank decodes at once
NUM_EXAMPLES, EXAMPLE_LEN, EVAL_BATCH = 32, 64, 8
SIZES = {
    # a decoding step is mostly Python overhead: a batch of 4 costs about what a batch of 8 does
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=2048, max_position_embeddings=256),
    # the matrix products are a good part of a step: splitting the batch over ranks pays
    "small": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192, max_position_embeddings=256),
}

GENERATE_KWARGS = dict(max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS, do_sample=False)

# Reads MODEL_DIR, PROMPTS, GENERATE_KWARGS, EXAMPLES on the ranks; defines timed(kind).
RANK_SETUP = """
import time, torch, fsdp2nb
model, tokenizer = fsdp2nb.load_model(MODEL_DIR, engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32"))
every_prompt = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")

def run_fsdp2nb():
    fsdp2nb.generate(model, tokenizer, PROMPTS, **GENERATE_KWARGS)

def run_plain():
    model.generate(**every_prompt, pad_token_id=tokenizer.pad_token_id, **GENERATE_KWARGS)

def run_many():
    fsdp2nb.generate(model, tokenizer, MANY_PROMPTS, batch_size=MANY_BATCH, **GENERATE_KWARGS)

def run_evaluate():
    fsdp2nb.evaluate(model, EXAMPLES, batch_size=EVAL_BATCH)

def timed(kind):
    run = {"fsdp2nb": run_fsdp2nb, "plain": run_plain, "many": run_many, "evaluate": run_evaluate}[kind]
    dist.barrier()
    started = time.perf_counter()
    run()  # each ends in a collective (a gather, or the last token's all-gathers): every rank is done
    return time.perf_counter() - started

for kind in ("fsdp2nb", "plain", "many", "evaluate"):  # untimed: first calls build caches
    timed(kind)
"""


def examples() -> list[dict]:
    import torch

    ids = torch.randint(3, 2048, (NUM_EXAMPLES, EXAMPLE_LEN), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row.tolist()} for row in ids]


class Whole:
    """The checkpoint whole in this process: batched generate, and a plain evaluation loop."""

    TASKS = ("generate", "many", "evaluate")

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.batches = {"generate": self._batches(PROMPTS, len(PROMPTS)), "many": self._batches(MANY_PROMPTS, MANY_BATCH)}
        self.threads = {task: self._faster_threads(self._seconds_of(task)) for task in self.TASKS}
        print("whole model, threads: " + ", ".join(f"{task} {threads}" for task, threads in self.threads.items()))

    @staticmethod
    def _faster_threads(measure) -> int:  # a measuring function
        """torch's default threads or one, whichever runs `measure` faster (the better of two runs each)."""
        import torch

        default, seconds = torch.get_num_threads(), {}
        for threads in (default, 1):
            torch.set_num_threads(threads)
            measure()  # untimed, as on the ranks
            seconds[threads] = min(measure(), measure())
        torch.set_num_threads(default)
        return min(seconds, key=seconds.get)

    def timed(self, task: str) -> float:
        """Seconds of one run of `task` (one of TASKS) on its faster thread count."""
        import torch

        default = torch.get_num_threads()
        torch.set_num_threads(self.threads[task])
        try:
            return self._seconds_of(task)()
        finally:
            torch.set_num_threads(default)

    def _batches(self, prompts: list[str], batch_size: int) -> list:
        return [self.tokenizer(prompts[start:start + batch_size], return_tensors="pt", padding=True,
                               padding_side="left") for start in range(0, len(prompts), batch_size)]

    def _seconds_of(self, task: str):
        return self.evaluate_s if task == "evaluate" else lambda: self.generate_s(self.batches[task])

    def generate_s(self, batches: list) -> float:
        """Seconds to generate for `batches`, one after the other."""
        started = time.perf_counter()
        for inputs in batches:
            self.model.generate(**inputs, pad_token_id=self.tokenizer.pad_token_id, **GENERATE_KWARGS)
        return time.perf_counter() - started

    def evaluate_s(self) -> float:
        import torch
        import torch.nn.functional as F

        started = time.perf_counter()
        ids = torch.tensor([example["input_ids"] for example in EXAMPLES])
        total = 0.0
        with torch.no_grad():
            for start in range(0, len(ids), EVAL_BATCH):
                batch = ids[start:start + EVAL_BATCH]  # (batch, length)
                logits = self.model(input_ids=batch).logits
                total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                               reduction="sum"))
        return time.perf_counter() - started


EXAMPLES = examples()


def in_cell(kernel: Kernel, kind: str) -> float:
    run = kernel.execute(f"%%fsdp2\nseconds = timed({kind!r})\nif rank == 0: print('SECONDS', seconds)", timeout=600)
    if run.status != "ok":
        raise RuntimeError(f"the {kind} cell failed:\n{run.traceback_text}")
    return float(re.search(r"SECONDS ([0-9.e-]+)", run.stdout).group(1))


def start_pool(num_ranks: int, model_dir: str) -> Kernel:
    kernel = Kernel(env=WITHOUT_GPUS)
    kernel.execute("%load_ext fsdp2nb")
    if kernel.execute(f"%fsdp2 start --cpu {num_ranks} --no-dashboard").status != "ok":
        raise RuntimeError("the pool did not start")
    settings = (f"MODEL_DIR = {model_dir!r}\nPROMPTS = {PROMPTS!r}\nGENERATE_KWARGS = {GENERATE_KWARGS!r}\n"
                f"MANY_PROMPTS = {MANY_PROMPTS!r}\nMANY_BATCH = {MANY_BATCH}\nEVAL_BATCH = {EVAL_BATCH}\nEXAMPLES = {EXAMPLES!r}\n")
    run = kernel.execute("%%fsdp2\n" + settings + RANK_SETUP, timeout=600)
    if run.status != "ok":
        raise RuntimeError(f"the set-up cell failed:\n{run.traceback_text}")
    return kernel


def measure(num_ranks: int, model_dir: str, whole: Whole, rounds: int) -> dict[str, list[float]]:
    """Seconds per run of each way, `rounds` alternating rounds on a pool of `num_ranks`."""
    runs: dict[str, list[float]] = {"whole": [], "fsdp2nb": [], "plain": [], "whole_many": [], "many": [],
                                    "whole_evaluate": [], "evaluate": []}
    kernel = start_pool(num_ranks, model_dir)
    try:
        for _ in range(rounds):
            runs["whole"].append(whole.timed("generate"))
            runs["fsdp2nb"].append(in_cell(kernel, "fsdp2nb"))
            runs["plain"].append(in_cell(kernel, "plain"))
            runs["whole_many"].append(whole.timed("many"))
            runs["many"].append(in_cell(kernel, "many"))
            runs["whole_evaluate"].append(whole.timed("evaluate"))
            runs["evaluate"].append(in_cell(kernel, "evaluate"))
    finally:
        kernel.stop()
    return runs


def print_rates(runs: dict[str, list[float]], label: str) -> None:
    tokens = len(PROMPTS) * NUM_NEW_TOKENS
    rate = {name: [tokens / seconds for seconds in runs[name]] for name in ("whole", "fsdp2nb", "plain")}
    print(f"\n{label} (CPU), {len(runs['whole'])} alternating rounds; tokens/s, median (best): "
          + ", ".join(f"{name} {statistics.median(values):.0f} ({max(values):.0f})" for name, values in rate.items()))
    for first, second, goal in (("fsdp2nb", "whole", ">= 0.8"), ("plain", "whole", "(0.15 measured before)"),
                                ("fsdp2nb", "plain", "")):
        print_ratio(rate[first], rate[second], f"generate {first} / {second}", goal)
    many_tokens = len(MANY_PROMPTS) * NUM_NEW_TOKENS
    many = [many_tokens / s for s in runs["many"]]
    whole_many = [many_tokens / s for s in runs["whole_many"]]
    print(f"  {len(MANY_PROMPTS)} prompts, {MANY_BATCH} at once, tokens/s, median (best): fsdp2nb "
          f"{statistics.median(many):.0f} ({max(many):.0f}), whole in one process {statistics.median(whole_many):.0f} "
          f"({max(whole_many):.0f})")
    print_ratio(many, whole_many, "many prompts fsdp2nb / whole", ">= 1")
    eval_tokens = NUM_EXAMPLES * (EXAMPLE_LEN - 1)
    evaluate = [eval_tokens / s for s in runs["evaluate"]]
    whole = [eval_tokens / s for s in runs["whole_evaluate"]]
    print(f"  evaluate, scored tokens/s, median (best): fsdp2nb {statistics.median(evaluate):.0f} "
          f"({max(evaluate):.0f}), whole in one process {statistics.median(whole):.0f} ({max(whole):.0f})")
    print_ratio(evaluate, whole, "evaluate fsdp2nb / whole", "")


def print_ratio(first: list[float], second: list[float], label: str, goal: str) -> None:
    paired = sorted(a / b for a, b in zip(first, second, strict=True))
    print(f"  {label:>28}: ratio of medians {statistics.median(first) / statistics.median(second):.2f}, "
          f"of best runs {max(first) / max(second):.2f}, paired {' '.join(f'{r:.2f}' for r in paired)} "
          f"(median {statistics.median(paired):.2f})" + (f"  goal {goal}" if goal else ""))


def main() -> None:
    from fsdp2nb.examples.tiny_models import save_tiny_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per pool size")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pool sizes (CPU ranks)")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["tiny", "small"], help="model sizes")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="fsdp2nb-bench-gen-")
    print(f"load average before: {load_average()}")
    results: dict[str, dict] = {}
    for size in args.sizes:
        model_dir = str(save_tiny_checkpoint(os.path.join(root, size), "llama", **SIZES[size]))
        whole = Whole(model_dir)
        print(f"{size}: {whole.model.num_parameters() / 1e6:.1f} M parameters")
        for num_ranks in args.ranks:
            results[f"{size}, {num_ranks} ranks"] = measure(num_ranks, model_dir, whole, args.rounds)
    print(json.dumps(results))
    print(f"load average after: {load_average()}")
    for label, runs in results.items():
        print_rates(runs, label)


if __name__ == "__main__":
    main()
