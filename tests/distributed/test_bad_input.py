"""Bad input to every public function of `fsdp2nb.__all__` raises a subclass of `Fsdp2nbError` with a
one-line message: in the notebook's process (no process group: what runs only on ranks says so) and
on 2 gloo ranks. The tables must name every public function; what is left out is listed with why."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import pytest

import fsdp2nb
from fsdp2nb.examples.tiny_models import save_tiny_checkpoint
from tests.support.gloo_harness import run_ranks

pytest.importorskip("transformers")

NOT_CALLED_WITH_USER_INPUT = {
    "Fsdp2nbError": "an error class",
    "RankError": "an error class",
    "UsageMistake": "an error class",
    "load_ipython_extension": "IPython calls it with its shell (%load_ext)",
    "unload_ipython_extension": "IPython calls it with its shell (%unload_ext)",
    "profile": "a context manager that takes no arguments",
}


def _trainer_with_bad_arguments(directory: str, model) -> None:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=directory, load_best_model_at_end=True, save_only_model=True,
                             eval_strategy="steps", save_strategy="steps", use_cpu=True, report_to="none")
    data = [{"input_ids": [1, 2], "labels": [1, 2]}]
    fsdp2nb.trainer_for(Trainer)(model=model, args=args, train_dataset=data, eval_dataset=data)


def _train_begin_on_other_world_size() -> None:
    from transformers import TrainerControl, TrainerState

    fsdp2nb.TrainerCallback().on_train_begin(SimpleNamespace(world_size=4), TrainerState(max_steps=5), TrainerControl())


# name in fsdp2nb.__all__ -> (the error class expected, a call with bad input); `where` holds paths
IN_THE_NOTEBOOK: dict[str, tuple[str, Callable[[SimpleNamespace], object]]] = {
    "Checkpointer": ("InvalidValue", lambda where: fsdp2nb.Checkpointer(where.empty, keep=0)),
    "Checkpointer, memory_every": ("InvalidValue", lambda where: fsdp2nb.Checkpointer(where.empty, memory_every=0)),
    "FSDP2Engine": ("InvalidValue", lambda where: fsdp2nb.FSDP2Engine(mixed_precision="fp64")),
    "FSDP2Engine, outside a pool": ("NoProcessGroup", lambda where: fsdp2nb.FSDP2Engine()),
    "load_model": ("InvalidValue", lambda where: fsdp2nb.load_model(where.model, init="lazy")),
    "load_model, outside a pool": ("NoProcessGroup", lambda where: fsdp2nb.load_model(where.model)),
    "hsdp_mesh, outside a pool": ("NoProcessGroup", lambda where: fsdp2nb.hsdp_mesh()),
    "clip_grad_norm_": ("InvalidValue", lambda where: fsdp2nb.clip_grad_norm_(3, 1.0)),
    "log": ("InvalidValue", lambda where: fsdp2nb.log(1, loss="low")),
    "log, step": ("InvalidValue", lambda where: fsdp2nb.log("first", loss=1.0)),
    "plan_memory": ("InvalidValue", lambda where: fsdp2nb.plan_memory(os.path.join(where.empty, "none"), 2)),
    "plan_memory, world_size": ("InvalidValue", lambda where: fsdp2nb.plan_memory(where.model, 0)),
    "trainer_for": ("InvalidValue", lambda where: fsdp2nb.trainer_for(object())),
    "TrainerCallback": ("UsageMistake", lambda where: _train_begin_on_other_world_size()),
    "generate": ("GenerationInputError", lambda where: fsdp2nb.generate(None, None, 42)),
    "evaluate": ("EvaluationInputError", lambda where: fsdp2nb.evaluate(None, 42)),
    "export_hf": ("InvalidValue", lambda where: fsdp2nb.export_hf(None, where.empty, max_shard_bytes=0)),
}

ON_RANKS: dict[str, tuple[str, Callable[[SimpleNamespace], object]]] = {
    "load_model": ("ModelNotFound", lambda where: fsdp2nb.load_model(os.path.join(where.empty, "no-model"))),
    "hsdp_mesh": ("InvalidMesh", lambda where: fsdp2nb.hsdp_mesh(replicate=3)),
    "FSDP2Engine": ("InvalidMesh", lambda where: fsdp2nb.FSDP2Engine(mesh="flat")),
    "Checkpointer": ("CheckpointLoadError",
                     lambda where: fsdp2nb.Checkpointer(where.checkpoints).track(model=where.loaded()).load(7)),
    "FSDP2TrainerMixin": ("InvalidValue", lambda where: _trainer_with_bad_arguments(where.trainer, where.loaded())),
    "generate": ("GenerationInputError", lambda where: fsdp2nb.generate(where.loaded(), None, [])),
}


def _outcome(call: Callable[[SimpleNamespace], object], where: SimpleNamespace) -> tuple[str, list[str], str]:
    """(the error's class, the names of the classes it derives from, its message), or no error."""
    try:
        call(where)
    except Exception as error:
        return type(error).__name__, [cls.__name__ for cls in type(error).__mro__], str(error)
    return "no error", [], ""


def _check(outcomes: dict[str, tuple[str, list[str], str]], table: dict) -> None:
    for case, (expected, _) in table.items():
        name, bases, message = outcomes[case]
        assert name == expected and "Fsdp2nbError" in bases, (case, name, message)
        assert message.strip() and "\n" not in message.strip(), (case, message)


def test_the_tables_name_every_public_function():
    covered = {case.split(",")[0] for case in [*IN_THE_NOTEBOOK, *ON_RANKS]}
    assert covered | set(NOT_CALLED_WITH_USER_INPUT) == set(fsdp2nb.__all__)


def test_bad_input_in_the_notebook_raises_one_line_fsdp2nb_errors(tmp_path):
    where = SimpleNamespace(empty=str(tmp_path), model=str(save_tiny_checkpoint(tmp_path / "model", "llama")))
    _check({case: _outcome(call, where) for case, (_, call) in IN_THE_NOTEBOOK.items()}, IN_THE_NOTEBOOK)


def _on_ranks(model_path: str, shared: str) -> dict[str, tuple[str, list[str], str]]:
    loaded: list = []

    def load_once():
        if not loaded:
            loaded.append(fsdp2nb.load_model(model_path)[0])
        return loaded[0]

    where = SimpleNamespace(empty=shared, checkpoints=os.path.join(shared, "ckpt"),
                            trainer=os.path.join(shared, "trainer"), loaded=load_once)
    return {case: _outcome(call, where) for case, (_, call) in ON_RANKS.items()}


def test_bad_input_on_ranks_raises_one_line_fsdp2nb_errors(tmp_path):
    model_path = str(save_tiny_checkpoint(tmp_path / "model", "llama"))
    per_rank = run_ranks(_on_ranks, 2, model_path, str(tmp_path))
    for outcomes in per_rank:
        _check(outcomes, ON_RANKS)
    assert per_rank[0] == per_rank[1]  # every rank refuses alike
