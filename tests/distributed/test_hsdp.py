"""HSDP (a 2 x 2 `("replicate", "shard")` mesh) on 4 gloo ranks against the flat mesh of the same 4.

Both meshes train the same model on the same per-rank batches; FSDP2 averages gradients over all 4
ranks either way, so losses and clipped norms agree (summed in another order: within 1e-5), and
everything built on the engine (LoRA, activation checkpointing, gradient accumulation, the
Checkpointer, export_hf, generate, a Trainer, the dashboard's readings) works on the 2-D mesh.
Checkpoints cross mesh shapes and world sizes. One spawn of 4 ranks does all of it, so the
module costs one start; a second, of 2 ranks, loads what the 4 saved.
"""

from __future__ import annotations

import pytest
import torch

from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.checkpoint_helpers import assert_same
from tests.support.gloo_harness import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")

WORLD_SIZE = 4
REPLICATE = 2
NUM_STEPS = 4
MAX_NORM = 0.1  # under every run's first norm, so clipping acts
SAVED_STEP = NUM_STEPS - 1
MESHES = ("flat", "hsdp")
# name: (lora, activation_checkpointing, micro-batches per step)
RUNS = {"full": (False, False, 1), "lora": (True, False, 1), "accumulated_ac": (False, True, 2)}


def _meshes() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2nb

    return {"flat": init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp_shard",)),
            "hsdp": fsdp2nb.hsdp_mesh(replicate=REPLICATE)}


def _batch(micro: int) -> torch.Tensor:
    """This rank's rows of a global batch of 4 x 2 sequences; the same on either mesh and at every step."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(micro)
    rows = torch.randint(3, 131, (WORLD_SIZE * 2, 12), generator=generator)
    return rows[2 * dist.get_rank(): 2 * dist.get_rank() + 2]


def _load(path: str, mesh, *, lora: bool = False, activation_checkpointing: bool = False):
    from peft import LoraConfig

    import fsdp2nb

    torch.manual_seed(0)  # the adapters' seed, drawn on rank 0
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if lora else None
    model, tokenizer = fsdp2nb.load_model(path, lora=config, mesh=mesh, activation_checkpointing=activation_checkpointing,
                                          engine=fsdp2nb.FSDP2Engine(mixed_precision="fp32", mesh=mesh))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, tokenizer, optimizer


def _train(model, optimizer, num_micro: int) -> tuple[list[float], list[float]]:
    """NUM_STEPS steps; with several micro-batches, gradients are reduced after the last only."""
    import torch.distributed as dist

    import fsdp2nb

    losses, norms = [], []
    for _ in range(NUM_STEPS):
        total = torch.zeros(())
        for micro in range(num_micro):
            model.set_requires_gradient_sync(micro == num_micro - 1)
            ids = _batch(micro)
            loss = model(input_ids=ids, labels=ids).loss / num_micro
            loss.backward()
            total += loss.detach()
        norms.append(fsdp2nb.clip_grad_norm_(model, MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / WORLD_SIZE)
    return losses, norms


def _full(model) -> dict[str, torch.Tensor]:
    from tests.support.checkpoint_helpers import full_model_state

    return full_model_state(model)


def _trained_runs(path: str, meshes: dict) -> tuple[dict, dict]:
    results, kept = {}, {}
    for name, (lora, ac, num_micro) in RUNS.items():
        for mesh_name, mesh in meshes.items():
            model, tokenizer, optimizer = _load(path, mesh, lora=lora, activation_checkpointing=ac)
            losses, norms = _train(model, optimizer, num_micro)
            results[name, mesh_name] = dict(losses=losses, norms=norms, state=_full(model))
            if name == "full":
                kept[mesh_name] = (model, tokenizer, optimizer)
    return results, kept


def _checkpoints_across_meshes(path: str, root: str, meshes: dict, kept: dict) -> dict:
    """Each mesh saves its trained run; a fresh model on the other mesh loads it."""
    from fsdp2nb.checkpoint import Checkpointer
    from tests.support.checkpoint_helpers import full_optim_state

    saved, loaded = {}, {}
    for mesh_name, (model, _, optimizer) in kept.items():
        with Checkpointer(f"{root}/ckpt-{mesh_name}", async_save=False) as ckpt:
            ckpt.track(model=model, optimizer=optimizer).save(SAVED_STEP)
        saved[mesh_name] = dict(model=_full(model), optim=full_optim_state(model, optimizer))
    for source, target in (("hsdp", "flat"), ("flat", "hsdp")):
        model, _, optimizer = _load(path, meshes[target])
        _train(model, optimizer, 1)  # different values, so that the load must replace them
        with Checkpointer(f"{root}/ckpt-{source}", async_save=False) as ckpt:
            step = ckpt.track(model=model, optimizer=optimizer).load("latest")
        loaded[f"{source}->{target}"] = dict(step=step, model=_full(model), optim=full_optim_state(model, optimizer))
    return dict(saved=saved, loaded=loaded)


def _dashboard_readings(model, optimizer, root: str) -> dict:
    """What a rank's sampler would send: its memory figures, and rank 0's checkpoint panel."""
    import torch.distributed as dist

    from fsdp2nb.checkpoint import Checkpointer
    from fsdp2nb.worker.sampler import ResourceSampler

    ckpt = Checkpointer(f"{root}/panel", async_save=False).track(model=model, optimizer=optimizer)
    ckpt.save(SAVED_STEP)
    sampler = ResourceSampler(dist.get_rank(), "cpu", send=lambda snapshot: None, is_busy=lambda: False)
    sampler.refresh_tracked_sizes()
    snapshot = sampler.sample()
    ckpt.close()
    view = snapshot.checkpoint
    return dict(param_bytes=snapshot.param_bytes, optimizer_bytes=snapshot.optimizer_bytes,
                panel_steps=None if view is None else [entry.step for entry in view.status.entries])


def _exported_and_generated(meshes: dict, kept: dict, root: str) -> dict:
    import fsdp2nb

    model, tokenizer, _ = kept["hsdp"]
    fsdp2nb.export_hf(model, f"{root}/export-hsdp")
    texts = {name: fsdp2nb.generate(entry[0], entry[1], ["hello", "the"], max_new_tokens=6, do_sample=False)
             for name, entry in kept.items()}
    return dict(texts=texts)


def _trainer_losses(path: str, root: str, meshes: dict) -> dict:
    """Two Trainer steps on each mesh, from the same start."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import fsdp2nb

    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, 131, (16, 12), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in rows]
    losses: dict[str, dict[int, float]] = {}
    for mesh_name, mesh in meshes.items():
        model, _, _ = _load(path, mesh)
        seen = losses.setdefault(mesh_name, {})

        class Losses(TrainerCallback):
            def __init__(self, seen: dict[int, float]) -> None:
                self.seen = seen

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    self.seen[state.global_step] = logs["loss"]

        args = TrainingArguments(output_dir=f"{root}/trainer-{mesh_name}", max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-2, save_strategy="no", report_to="none", use_cpu=True,
                                 logging_steps=1, disable_tqdm=True, seed=0)
        fsdp2nb.trainer_for(Trainer)(model=model, args=args, train_dataset=data, callbacks=[Losses(seen)]).train()
    return losses


def _mesh_mistakes(path: str, meshes: dict) -> dict[str, str]:
    """The one line each mesh the engine cannot use gets, by what was wrong."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2nb
    from fsdp2nb.engine import InvalidMesh

    attempts = {
        "a tuple": lambda: fsdp2nb.FSDP2Engine(mesh=(2, 2)),
        "unnamed 2-D": lambda: fsdp2nb.FSDP2Engine(mesh=init_device_mesh("cpu", (2, 2))),
        "unknown names": lambda: fsdp2nb.FSDP2Engine(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))),
        "part of the ranks": lambda: fsdp2nb.FSDP2Engine(mesh=meshes["hsdp"]["shard"]),
        "replicate not dividing": lambda: fsdp2nb.hsdp_mesh(replicate=3),
        "one host, no replicate": lambda: fsdp2nb.hsdp_mesh(),
        "engine and another mesh": lambda: fsdp2nb.load_model(path, mesh=meshes["hsdp"],
                                                              engine=fsdp2nb.FSDP2Engine(mesh=meshes["flat"])),
    }
    said = {}
    for what, attempt in attempts.items():
        try:
            attempt()
        except InvalidMesh as error:
            said[what] = str(error)
        else:
            said[what] = "accepted"
    return said


def _on_four_ranks(path: str, root: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    meshes = _meshes()
    result = dict(mistakes=_mesh_mistakes(path, meshes))
    runs, kept = _trained_runs(path, meshes)
    param = next(kept["hsdp"][0].parameters())
    assert isinstance(param, DTensor)
    result.update(
        mesh=(tuple(meshes["hsdp"].shape), meshes["hsdp"].mesh.tolist(), meshes["hsdp"].mesh_dim_names),
        placements=str(param.placements), runs=runs,
        checkpoints=_checkpoints_across_meshes(path, root, meshes, kept),
        readings={name: _dashboard_readings(model, optimizer, f"{root}/{name}")
                  for name, (model, _, optimizer) in kept.items()},
        **_exported_and_generated(meshes, kept, root),
        trainer=_trainer_losses(path, root, meshes),
    )
    if dist.get_rank() != 0:  # the full states are the same on every rank: send them once
        result.update(runs=None, checkpoints=None)
    return result


def _load_on_two_ranks(path: str, root: str) -> dict:
    """The 2 x 2 run's checkpoint on 2 ranks: flat, and HSDP 2 x 1 (replicas only)."""
    import fsdp2nb
    from fsdp2nb.checkpoint import Checkpointer
    from tests.support.checkpoint_helpers import full_optim_state

    loaded = {}
    for name, mesh in (("flat", None), ("hsdp", fsdp2nb.hsdp_mesh(replicate=2))):
        model, _, optimizer = _load(path, mesh)
        with Checkpointer(f"{root}/ckpt-hsdp", async_save=False) as ckpt:
            step = ckpt.track(model=model, optimizer=optimizer).load("latest")
        loaded[name] = dict(step=step, model=_full(model), optim=full_optim_state(model, optimizer),
                            placements=str(next(model.parameters()).placements))
    return loaded


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    path = save_tiny_checkpoint(root / "model", "llama")
    results = run_ranks(_on_four_ranks, WORLD_SIZE, str(path), str(root))
    return root, path, results


def test_parameters_are_replicated_across_rows_and_sharded_within(four):
    result = four[2][0]
    assert result["mesh"] == ((2, 2), [[0, 1], [2, 3]], ("replicate", "shard"))
    assert result["placements"] == "(Replicate(), Shard(dim=0))"


@pytest.mark.parametrize("name", list(RUNS))
def test_training_gives_the_flat_meshs_losses_norms_and_weights(four, name):
    runs = four[2][0]["runs"]
    flat, hsdp = runs[name, "flat"], runs[name, "hsdp"]
    assert hsdp["losses"] == pytest.approx(flat["losses"], rel=1e-5)
    assert hsdp["norms"] == pytest.approx(flat["norms"], rel=1e-5)
    assert flat["losses"][-1] < flat["losses"][0]  # it trained
    assert flat["norms"][0] > MAX_NORM  # so clipping acted
    for key, value in flat["state"].items():
        torch.testing.assert_close(hsdp["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_checkpoint_saved_on_one_mesh_shape_loads_on_the_other(four):
    checkpoints = four[2][0]["checkpoints"]
    for source, target in (("hsdp", "flat"), ("flat", "hsdp")):
        loaded, saved = checkpoints["loaded"][f"{source}->{target}"], checkpoints["saved"][source]
        assert loaded["step"] == SAVED_STEP
        assert_same(loaded["model"], saved["model"])
        assert_same(loaded["optim"], saved["optim"])


def test_a_checkpoint_of_the_2x2_mesh_loads_on_2_ranks(four):
    root, path, results = four
    saved = results[0]["checkpoints"]["saved"]["hsdp"]
    loaded = run_ranks(_load_on_two_ranks, 2, str(path), str(root))[1]
    assert loaded["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"
    for entry in loaded.values():
        assert entry["step"] == SAVED_STEP
        assert_same(entry["model"], saved["model"])
        assert_same(entry["optim"], saved["optim"])


def test_export_hf_of_the_hsdp_model_loads_with_from_pretrained(four):
    from transformers import AutoModelForCausalLM

    root, _, results = four
    loaded = AutoModelForCausalLM.from_pretrained(root / "export-hsdp", dtype=torch.float32)
    assert_same(dict(loaded.state_dict()), results[0]["checkpoints"]["saved"]["hsdp"]["model"])


def test_generate_gives_the_flat_meshs_text(four):
    texts = [result["texts"] for result in four[2]]
    assert all(entry == texts[0] for entry in texts)
    assert texts[0]["hsdp"] == texts[0]["flat"]


def test_the_dashboard_shows_each_ranks_share_and_the_checkpoint(four):
    results = four[2]
    flat = sum(r["readings"]["flat"]["param_bytes"] for r in results)
    hsdp = sum(r["readings"]["hsdp"]["param_bytes"] for r in results)
    # Two sharded copies of the model, one per row; FSDP2 pads each shard to the first rank's
    # chunk, over 4 ranks flat and over 2 in a row, so the padding differs a little.
    assert hsdp == pytest.approx(2 * flat, rel=0.05)
    # AdamW's moments are sharded like the parameters; its `step` counts are whole on every rank.
    optimizer = [sum(r["readings"][name]["optimizer_bytes"] for r in results) for name in MESHES]
    assert optimizer[1] == pytest.approx(2 * optimizer[0], rel=0.01)
    assert results[0]["readings"]["hsdp"]["panel_steps"] == [SAVED_STEP]


def test_a_trainer_trains_the_hsdp_model_as_the_flat_one(four):
    trainer = four[2][0]["trainer"]
    assert sorted(trainer["hsdp"]) == [1, 2]
    assert [trainer["hsdp"][s] for s in (1, 2)] == pytest.approx([trainer["flat"][s] for s in (1, 2)], rel=1e-5)


def test_a_mesh_the_engine_cannot_use_gets_one_line_saying_what_to_pass(four):
    said = four[2][0]["mistakes"]
    assert all(text != "accepted" and "\n" not in text for text in said.values()), said
    assert "is not a DeviceMesh" in said["a tuple"] and "hsdp_mesh()" in said["a tuple"]
    for what in ("unnamed 2-D", "unknown names"):
        assert "('replicate', 'shard')" in said[what], said[what]
    assert "covers 2 ranks but the process group has 4" in said["part of the ranks"]
    assert "replicate=3 does not divide the 4 ranks; choose one of (1, 2, 4)" in said["replicate not dividing"]
    assert "hsdp_mesh(replicate=2)" in said["one host, no replicate"]
    assert "engine=fsdp2nb.FSDP2Engine(..., mesh=mesh)" in said["engine and another mesh"]
