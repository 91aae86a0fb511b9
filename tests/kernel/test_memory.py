"""Memory from a notebook on 3 CPU ranks (uneven shards: the tiny model's 131-token vocabulary and
70-wide MLP split 44/44/43 and 24/24/22): `%fsdp2 plan` against what the ranks hold after a step.
Five layers, of which the plan builds and traces two (the second standing for the other four).

One pool serves the module.
"""

from __future__ import annotations

import json

import pytest

from tests.support.kernel_client import WITHOUT_GPUS, Kernel

WORLD_SIZE = 3
BATCH, SEQ = 2, 32

_RANK_SETUP = """%%fsdp2
import fsdp2nb
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from fsdp2nb.worker.sampler import held_bytes
if rank == 0:
    save_tiny_checkpoint(model_dir, "llama", num_hidden_layers=5)  # the plan traces 2 blocks for the 5
dist.barrier()

def measured_step(mixed_precision, lora_rank):
    \"\"\"Load, run one step, and say what this rank held: the storages of the parameters, of the
    gradients after backward, of the optimizer state after the step, and those autograd saved in
    forward (at its end, less the parameters: FSDP2 has freed the gathered blocks by then).\"\"\"
    from peft import LoraConfig
    lora = None if not lora_rank else LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                  target_modules="all-linear", lora_dropout=0.0)
    engine = fsdp2nb.FSDP2Engine(mixed_precision=mixed_precision)
    model, _ = fsdp2nb.load_model(model_dir, engine=engine, lora=lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 131, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    params = list(model.parameters())  # the sharded ones: after forward the head and root are gathered
    saved = {}
    def pack(tensor):
        saved[id(tensor.untyped_storage())] = tensor.untyped_storage()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    held_params = {id((p.to_local() if hasattr(p, "to_local") else p).untyped_storage())
                   for p in [*params, *model.parameters()]}
    activations = sum(s.nbytes() for key, s in saved.items() if key not in held_params)
    del saved
    loss.backward()
    gradients = held_bytes([p.grad for p in params])
    optimizer.step()
    return dict(parameters=held_bytes(params), gradients=gradients, activations=activations,
                optimizer=held_bytes([v for state in optimizer.state.values() for v in state.values()]))
""".replace("BATCH, SEQ", f"{BATCH}, {SEQ}")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("memory") / "model"
    k = Kernel(env=WITHOUT_GPUS)
    assert k.execute("%load_ext fsdp2nb").status == "ok"
    run = k.execute(f"%fsdp2 start --cpu {WORLD_SIZE} --no-dashboard")
    assert run.status == "ok", run.traceback_text
    run = k.execute(f"model_dir = {str(model_dir)!r}\n%fsdp2 push model_dir")
    assert run.status == "ok", run.traceback_text
    run = k.execute(_RANK_SETUP, timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    yield k
    k.stop()


def _plan_and_measure(kernel, mixed_precision: str, lora_rank: int) -> tuple[list[dict], list[dict]]:
    """(plan per rank, measured per rank): the plan made in the kernel by `%fsdp2 plan`."""
    run = kernel.execute(f"%%fsdp2\nmeasured = measured_step({mixed_precision!r}, {lora_rank})", timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    options = f"--cpu {WORLD_SIZE} --batch {BATCH} --seq {SEQ}" + (" --fp32" if mixed_precision == "fp32" else "")
    options += f" --lora {lora_rank}" if lora_rank else ""
    run = kernel.execute("import json\nmeasured = %fsdp2 pull measured --all --value\n"
                         f"plan = %fsdp2 plan {{model_dir}} {options}\n"
                         "print(json.dumps([list(plan.per_rank), [measured[r] for r in range(len(measured))]]))")
    assert run.status == "ok", run.traceback_text + run.stderr
    planned, measured = json.loads(run.stdout.strip().splitlines()[-1])
    return planned, measured


@pytest.mark.parametrize(("mixed_precision", "lora_rank"), [("fp32", 0), ("bf16", 0), ("bf16", 4), ("fp32", 4)],
                         ids=["full-fp32", "full-bf16", "lora-bf16", "lora-fp32"])
def test_the_plan_matches_what_each_rank_holds_after_a_step(kernel, mixed_precision, lora_rank):
    planned, measured = _plan_and_measure(kernel, mixed_precision, lora_rank)
    assert len(planned) == len(measured) == WORLD_SIZE
    for rank in range(WORLD_SIZE):
        errors = {category: planned[rank][category] / measured[rank][category] - 1 for category in measured[rank]}
        print(f"{mixed_precision} lora={lora_rank} rank {rank}: " + ", ".join(
            f"{c} {planned[rank][c]} planned / {measured[rank][c]} held ({e:+.1%})" for c, e in errors.items()))
        for category in ("parameters", "gradients", "optimizer"):
            assert abs(errors[category]) <= 0.03, (rank, category, planned[rank], measured[rank])
        assert abs(errors["activations"]) <= 0.25, (rank, planned[rank], measured[rank])
    # uneven shards: the last rank's optimizer state is smaller, its padded parameters are not
    assert measured[2]["optimizer"] < measured[0]["optimizer"] and planned[2]["optimizer"] < planned[0]["optimizer"]
    assert measured[2]["parameters"] == measured[0]["parameters"]


def test_plan_needs_no_pool_and_refuses_bad_options_in_one_line(kernel):
    run = kernel.execute("p = %fsdp2 plan {model_dir} --gpus 8 --memory 80GiB --lora 8 --ac\n"
                         "print(p.settings.world_size, p.settings.device, p.capacity_bytes, p.verdict[:9])")
    assert run.status == "ok", run.traceback_text
    assert run.stdout.strip() == f"8 cuda {80 * 2**30} fits with"
    for line, words in (("{model_dir} --cpu 2 --offload", "offload_params=True is not allowed on CPU ranks"),
                        ("/no/such/model --cpu 2", "does not exist"),
                        ("{model_dir} --memory lots", "not a memory size")):
        run = kernel.execute(f"%fsdp2 plan {line}")
        assert run.status == "error" and run.stderr.startswith("UsageError: ") and words in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_failed_allocation_is_split_by_the_loaded_model_without_a_checkpointer(kernel):
    """No Checkpointer: the split is the model `load_model` returned and the optimizer that stepped
    over it, kept out of the namespace (in a closure, as a Trainer keeps its own)."""
    run = kernel.execute("%%fsdp2\nmodel, _ = fsdp2nb.load_model(model_dir)\n"
                         "def trainer():\n    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
                         "    def step():\n        ids = torch.randint(0, 131, (2, 8))\n"
                         "        model(input_ids=ids, labels=ids).loss.backward()\n        optimizer.step()\n"
                         "    return step\nstep = trainer()\nstep()", timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute("%%fsdp2\nif rank == 1:\n    torch.empty(10**13, dtype=torch.uint8)")
    assert run.status == "error"
    text = run.traceback_text
    plan = kernel.execute("from fsdp2nb.sizes import size\n"
                          f"p = %fsdp2 plan {{model_dir}} --cpu {WORLD_SIZE}\n"
                          "print(size(p.per_rank[1]['parameters']), size(p.per_rank[1]['optimizer']))")
    params, optimizer = _two_sizes(plan.stdout)
    assert "rank 1 ran out of memory: it asked for 9.09 TiB" in text, text
    assert ("rank 1 held " in text and f"resident (RSS): model parameters {params}, gradients {params}, "
            f"optimizer state {optimizer}, other " in text), (text, plan.stdout)


def test_a_failed_allocation_says_what_each_failing_rank_asked_for_had_and_held(kernel):
    """Rank 1 asks the CPU allocator for 9 TiB, rank 2 numpy for 7 PiB (a MemoryError), rank 0
    succeeds; the ranks keep their state."""
    run = kernel.execute("%%fsdp2\nmodel, _ = fsdp2nb.load_model(model_dir)\n"
                         "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
                         "ids = torch.randint(0, 131, (2, 8))\nmodel(input_ids=ids, labels=ids).loss.backward()\n"
                         "optimizer.step()\nimport tempfile\n"
                         "ckpt = fsdp2nb.Checkpointer(tempfile.mkdtemp()).track(model=model, optimizer=optimizer)",
                         timeout=300)
    assert run.status == "ok", run.traceback_text + run.stderr
    run = kernel.execute("%%fsdp2\nimport numpy\nkept_before = 'still here'\n"
                         "if rank == 1:\n    torch.empty(10**13, dtype=torch.uint8)\n"
                         "if rank == 2:\n    numpy.empty(10**15)")
    assert run.status == "error"
    text = run.traceback_text
    assert "rank 1 ran out of memory: it asked for 9.09 TiB; the host had " in text, text
    assert "rank 2 ran out of memory: it asked for 7.11 PiB" in text, text
    assert "rank 0 ran out" not in text
    plan = kernel.execute("from fsdp2nb.sizes import size\n"
                          f"p = %fsdp2 plan {{model_dir}} --cpu {WORLD_SIZE}\n"
                          "print(size(p.per_rank[1]['parameters']), size(p.per_rank[1]['optimizer']))")
    params, optimizer = _two_sizes(plan.stdout)
    assert ("rank 1 held " in text and f"model parameters {params}, gradients {params}, "
            f"optimizer state {optimizer}, other " in text), (text, plan.stdout)
    after = kernel.execute("%%fsdp2\nprint(kept_before, type(model).__name__)")
    assert after.status == "ok" and after.stdout == "[all] still here FSDPLlamaForCausalLM\n", after.traceback_text


def _two_sizes(line: str) -> tuple[str, str]:
    words = line.split()  # "69 KiB 131 KiB"
    return f"{words[0]} {words[1]}", f"{words[2]} {words[3]}"


def test_memory_record_is_not_offered_until_it_is_built(kernel):
    run = kernel.execute("%fsdp2 memory record --steps 3")
    assert run.status == "error" and run.stderr.startswith("UsageError: %fsdp2 takes one of"), run.stderr
    assert "got 'memory'" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    help_text = kernel.execute("print(get_ipython().find_line_magic('fsdp2').__doc__)").stdout  # what %fsdp2? shows
    assert "memory record" not in help_text and "%fsdp2 plan" in help_text

def test_a_rank_killed_by_sigkill_says_whether_the_oom_killer_sent_it(kernel):
    """Last in the module: the pool restarts after the death."""
    from fsdp2nb.host_memory import kernel_log_names_oom_kill, oom_kill_count

    run = kernel.execute("%%fsdp2\nimport os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                         "import time\ntime.sleep(30)", timeout=120)
    assert run.status == "error"
    text = run.traceback_text
    assert "killed by SIGKILL" in text, text
    if oom_kill_count() is not None or kernel_log_names_oom_kill(0) is not None:  # readable here, as on the rank's host
        assert "the kernel's OOM killer did not send it" in text, text
    else:
        assert "the kernel's OOM killer is the usual sender of a SIGKILL" in text, text

