"""Train a `load_model` model with Hugging Face's `Trainer` (or TRL's `SFTTrainer`) as it is: sharded.

    Trainer = fsdp2nb.trainer_for(transformers.Trainer)   # or trl.SFTTrainer
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[fsdp2nb.TrainerCallback()])

A plain Trainer would wrap the FSDP2 model in DDP (on CPU accelerate never selects FSDP), which
fails on its DTensor parameters. `FSDP2TrainerMixin` takes the path transformers keeps for models
sharded at load time: no wrap, no `.to()`, the optimizer over the sharded parameters. It saves:

- `save_model` (and a checkpoint's weights) with `export_hf`: each rank writes the tensors
  it owns, nobody gathers the whole model; a LoRA model writes its adapter;
- a checkpoint's model and optimizer state with torch.distributed.checkpoint (`fsdp2nb_dcp/`),
  each rank its own shards; a peft model's frozen base weights are left out (they never change).

`resume_from_checkpoint` reads `fsdp2nb_dcp/` back into the sharded model and optimizer; the
scheduler, RNG and Trainer state come from Trainer's own files.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from fsdp2nb.checkpoint.hf_export import export_hf
from fsdp2nb.checkpoint.trainer_dirs import DCP_DIR
from fsdp2nb.errors import CheckpointLoadError, InvalidValue, WrongTrainerClass

logger = logging.getLogger(__name__)

_MARK = "_fsdp2nb_trainer_building"
_ACCELERATE_MARK = "_is_accelerate_prepared"  # set on a model by accelerate's prepare_model


class FSDP2TrainerMixin:
    """Mixed in before a `transformers.Trainer` class: trains an FSDP2 model without wrapping it again
    and saves/loads it shard-wise. Use `trainer_for(TrainerClass)` rather than subclassing by hand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
        if not isinstance(model, FSDPModule):
            raise WrongTrainerClass(f"{type(self).__name__} needs a model sharded with fully_shard "
                                    f"(fsdp2nb.load_model); got {type(model).__name__}: use the plain Trainer class")
        setattr(model, _MARK, True)  # read by fsdp2nb.TrainerCallback.on_init_end
        try:
            super().__init__(*args, **kwargs)
        finally:
            delattr(model, _MARK)
        if self.args.load_best_model_at_end and self.args.save_only_model:
            raise InvalidValue("load_best_model_at_end=True needs save_only_model=False with an FSDP2 model")
        # Set after __init__, which refuses optimizer checkpoints for such models: we save them with DCP.
        self.is_distributed_loading_by_transformers = True
        self.place_model_on_device = False
        self._prepared_the_model = False  # whether this trainer's accelerator has prepared self.model
        self._in_call = False

    # ---- the model between calls ----------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with self._accelerate_mark_held():
            return super().train(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self._accelerate_mark_held():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with self._accelerate_mark_held():
            return super().predict(*args, **kwargs)

    @contextlib.contextmanager
    def _accelerate_mark_held(self):
        """Accelerate marks a model it prepared on the model itself, and every later Accelerator
        then takes it as prepared: a plain Trainer given the model next would skip the DDP wrap
        that refuses it, train it unwrapped and fail deep in safetensors at its first save. So
        the mark is on the model only while one of this trainer's calls runs; between calls the
        model is as `load_model` left it, and a plain Trainer is refused as on a fresh model."""
        if self._in_call:  # evaluate() inside train()
            yield
            return
        model, self._in_call = self.model, True
        if self._prepared_the_model:  # prepared before: accelerate must not wrap its forward again
            setattr(model, _ACCELERATE_MARK, True)
        try:
            yield
        finally:
            self._in_call = False
            self._prepared_the_model = model.__dict__.pop(_ACCELERATE_MARK, False)

    # ---- saving -------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """An HF directory (weights or adapter, config, processor) written shard-wise; collective."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        export_hf(self.model, output_dir, processor=self.processing_class)
        if self.args.should_save:
            from transformers.trainer import TRAINING_ARGS_NAME

            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        model_state, optimizer_state = get_state_dict(self.model, _torch_optimizer(self.optimizer),
                                                      options=self._state_dict_options())
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=os.path.join(output_dir, DCP_DIR))
        if self.args.should_save:
            from transformers.trainer import SCHEDULER_NAME

            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ---- loading ------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        model = self.model if model is None else model
        options = self._state_dict_options()
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=_dcp_dir(resume_from_checkpoint))
        set_model_state_dict(model, state["model"], options=options)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer = _torch_optimizer(self.optimizer)
        options = self._state_dict_options()
        _, optimizer_state = get_state_dict(self.model, optimizer, options=options)
        state = {"optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=_dcp_dir(checkpoint))
        set_optimizer_state_dict(self.model, optimizer, state["optimizer"], options=options)
        from transformers.trainer import SCHEDULER_NAME

        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    # ---- training -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        """Gradient accumulation: reduce-scatter once, after the last micro-batch."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _state_dict_options(self) -> StateDictOptions:
        # A peft model's frozen base never changes: its checkpoints hold the adapter and its optimizer
        # state, and loading them leaves the base weights as they are (strict=False).
        is_peft = isinstance(getattr(self.model, "peft_config", None), dict)
        return StateDictOptions(ignore_frozen_params=is_peft, strict=not is_peft)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def _dcp_dir(checkpoint: str) -> str:
    path = os.path.join(checkpoint, DCP_DIR)
    if not os.path.isdir(path):
        raise CheckpointLoadError(f"{checkpoint} has no {DCP_DIR}/ to resume from: it was saved with save_only_model=True "
                                  "or without fsdp2nb.trainer_for; resume from a checkpoint saved with save_only_model=False")
    return path


@functools.cache
def trainer_for(trainer_class: type) -> type:
    """`trainer_class` (transformers.Trainer, trl.SFTTrainer, ...) able to train a model from
    `fsdp2nb.load_model` as it is sharded, and to save and resume it shard-wise."""
    from transformers import Trainer

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        given = trainer_class.__name__ if isinstance(trainer_class, type) else f"a {type(trainer_class).__name__}"
        raise InvalidValue(f"trainer_for takes a Trainer class (transformers.Trainer, trl.SFTTrainer, ...), not {given}")
    if issubclass(trainer_class, FSDP2TrainerMixin):
        return trainer_class
    return type(f"FSDP2{trainer_class.__name__}", (FSDP2TrainerMixin, trainer_class),
                {"__module__": __name__, "__doc__": f"{trainer_class.__name__} for FSDP2 models (fsdp2nb)."})


USE_TRAINER_FOR = "build the trainer with fsdp2nb.trainer_for(Trainer)(...) (or trainer_for(SFTTrainer))"

WRAPPED_IN_DDP = ("this FSDP2 model (fsdp2nb.load_model) was wrapped in DistributedDataParallel, as a plain "
                  f"transformers.Trainer does, and DDP cannot take its sharded parameters: {USE_TRAINER_FOR}")
"""What a rank says instead of the DTensor error DDP's first broadcast raises for such a model."""


def is_fsdp2_model_wrapped_in_ddp(error: BaseException) -> bool:
    """Whether `error` rose out of DistributedDataParallel's constructor given an FSDP2 model."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_init = DistributedDataParallel.__init__.__code__
    entry = error.__traceback__
    while entry is not None:
        frame = entry.tb_frame
        if frame.f_code is ddp_init and isinstance(frame.f_locals.get("module"), FSDPModule):
            return True
        entry = entry.tb_next
    return False


def is_building_fsdp2_trainer(model: Any) -> bool:
    """Whether `model` is being handed to a trainer made by `trainer_for` (for TrainerCallback's check)."""
    return getattr(model, _MARK, False)
