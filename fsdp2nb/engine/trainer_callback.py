"""`fsdp2nb.TrainerCallback()`: a Hugging Face `Trainer` (or TRL's) driven from the dashboard.

Pass it in `callbacks=[fsdp2nb.TrainerCallback()]`. On the ranks of a pool:

- what Trainer logs (`on_log`: loss, learning rate, grad norm) goes to `fsdp2nb.log`, so the
  dashboard plots it and `%fsdp2 metrics` lists it;
- the dashboard's Save makes Trainer save at a step's end (`control.should_save`), and Stop (or
  the notebook's stop button) ends training at a step's end (`control.should_training_stop`)
  instead of interrupting it; every rank agrees on both, so all ranks save or stop at the same
  step. The agreement is one all-reduce posted at a step's end and read at the next one's, so
  no step waits for it: a click lands at the end of the step after the one it came in, and at
  the last step (which nothing reads after) it is agreed at once;
- Trainer's progress (step of max_steps, steps per second, time left) is reported through
  `fsdp2nb.progress`, which the cell's progress bar and the dashboard show.
- Trainer's `checkpoint-N` directories are listed by rank 0 when training begins and after each
  save (`checkpoint/trainer_dirs.py`), and the panel shows that listing.

Outside a pool (plain Python) nobody listens: the callback logs into a buffer nobody reads and
reports progress to nobody, so the same script runs unchanged under torchrun or alone.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import transformers

from fsdp2nb import collectives, progress
from fsdp2nb.checkpoint import trainer_dirs
from fsdp2nb.checkpoint.requests import process_requests, process_stops
from fsdp2nb.errors import InvalidValue, UsageMistake
from fsdp2nb.metrics import log

logger = logging.getLogger(__name__)

NETWORK_REPORTERS = frozenset({"wandb", "comet_ml", "neptune", "clearml", "dagshub", "mlflow", "swanlab",
                               "trackio", "azure_ml"})
"""`report_to` integrations that send metrics over the network (tensorboard and codecarbon write files)."""


class TrainerCallback(transformers.TrainerCallback):
    """Feeds Trainer's logs, saves, stops and progress to and from fsdp2nb's dashboard.

    Example: `Trainer(model, args, train_dataset=data, callbacks=[fsdp2nb.TrainerCallback()])`.
    """

    def __init__(self) -> None:
        self._group = None
        self._task: progress.AnyTask = progress.SILENT
        self._listening = False
        self._saving_request = 0
        """The dashboard's save request that the save Trainer makes at this step serves."""
        self._posted: collectives.PostedMax | None = None
        """What the ranks were asked (save request, stop) at the last step's end, on its way."""

    def on_init_end(self, args, state, control, **kwargs: Any):
        _check_report_to(args)
        _check_trainer_class(kwargs.get("model"))
        return control

    def on_train_begin(self, args, state, control, **kwargs: Any):
        _check_world_size(args)
        self._posted = None  # left by a train() that raised: stale, and gloo runs it in order with the next
        if collectives.is_distributed() and self._group is None:
            self._group = collectives.new_gloo_group()  # CPU agreement, whatever the training backend
        process_stops().listen()
        self._listening = True
        self._task = progress.start_task("train", "training", total_items=int(state.max_steps or 0))
        self._task.advance(num_items=int(state.global_step))  # resumed: the bar starts where it left off
        _publish_checkpoints(args, state)
        return control

    def on_step_end(self, args, state, control, **kwargs: Any):
        self._task.advance(num_items=1)
        requests = process_requests()
        asked = (requests.pending(), int(process_stops().pending()))
        wanted, stop = self._posted.wait() if self._posted is not None else (0, 0)
        self._posted = None
        # The same on every rank (agreed values, Trainer's step count): all post, or none do.
        if stop or control.should_training_stop or state.global_step >= state.max_steps:
            now = self._agree(asked)  # no later step end would read a posted one
            wanted, stop = max(wanted, now[0]), max(stop, now[1])
        else:
            self._posted = collectives.post_all_max(asked, self._group)
        if wanted > requests.served():
            requests.mark_served(wanted, step=state.global_step)  # Trainer saves checkpoint-{global_step}
            self._saving_request = wanted
            control.should_save = True
        if stop:
            control.should_training_stop = True
            if state.is_world_process_zero:
                logger.warning("fsdp2nb: training stopped at step %d, as asked from the notebook", state.global_step)
        return control

    def on_save(self, args, state, control, **kwargs: Any):
        if self._saving_request:
            process_requests().mark_committed(self._saving_request)
            self._saving_request = 0
        _publish_checkpoints(args, state)
        return control

    def on_log(self, args, state, control, logs: dict | None = None, **kwargs: Any):
        numbers = {name: value for name, value in (logs or {}).items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if numbers:
            log(state.global_step, **numbers)
        return control

    def on_train_end(self, args, state, control, **kwargs: Any):
        self._drop_posted()
        self._task.finish()
        self._task = progress.SILENT
        if self._listening:
            process_stops().unlisten()
            self._listening = False
        return control

    def _agree(self, asked: tuple[int, int]) -> tuple[int, ...]:
        """The highest save request and whether any rank was asked to stop, the same on every rank."""
        return asked if self._group is None else collectives.all_max(asked, self._group)

    def _drop_posted(self) -> None:
        """Wait for a posted agreement nobody will act on (training ended after another callback
        stopped it): every rank posted it, so it completes, and the group is free again."""
        if self._posted is not None:
            self._posted.wait()
            self._posted = None


def _publish_checkpoints(args, state) -> None:
    """Rank 0 lists the `checkpoint-N` directories for the dashboard (at train start and after a
    save, which Trainer's rotation has followed by then)."""
    if state.is_world_process_zero:
        trainer_dirs.publish(trainer_dirs.list_trainer_checkpoints(args.output_dir))


def _check_world_size(args) -> None:
    world_size = collectives.get_world_size()
    if args.world_size != world_size:
        raise UsageMistake(f"TrainingArguments has world_size={args.world_size} but the process group has "
                           f"{world_size} ranks: build TrainingArguments inside the %%fsdp2 cell, on every rank")


def _check_trainer_class(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    from fsdp2nb.engine.hf_trainer import USE_TRAINER_FOR, WrongTrainerClass, is_building_fsdp2_trainer

    if isinstance(model, FSDPModule) and not is_building_fsdp2_trainer(model):
        raise WrongTrainerClass("this model is sharded with FSDP2 (fsdp2nb.load_model) and a plain Trainer would wrap it "
                         f"in DDP: {USE_TRAINER_FOR}")


def _check_report_to(args) -> None:
    reporters = NETWORK_REPORTERS.intersection(args.report_to or ())
    if not reporters:
        return
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    line = (f"report_to={sorted(reporters)} sends metrics over the network from rank 0; the dashboard has them "
            "already: pass report_to='none'")
    if offline:
        raise InvalidValue(line + " (HF_HUB_OFFLINE is set here)")
    logger.warning("fsdp2nb: %s", line)
