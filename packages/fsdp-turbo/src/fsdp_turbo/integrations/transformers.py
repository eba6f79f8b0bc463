"""transformers' ``Trainer`` on FSDPTurbo: ``with_fsdp_turbo(Trainer)`` returns a subclass.

    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    trainer = with_fsdp_turbo(Trainer)(model=model, args=args, train_dataset=ds,
                                       fsdp_turbo_config=FSDPTurboConfig(...))  # or a dict, or a YAML/TOML path
    trainer.train()

The script is otherwise unchanged and launched with ``torchrun``. The subclass applies
``FSDPTurbo(config, model)`` once, in its ``__init__``, before accelerate sees the model, and
tells the Trainer that the model owns its placement and gradient reduction, so accelerate
neither moves it nor wraps it again (no DDP, no second FSDP). Everything else is the
Trainer's own (its optimizer, scheduler, clipping over every mesh, logging and callbacks),
with four changes:

- **Data** (``trainer_data``): each data shard (``dp_rank`` of ``dp_size``), not each process,
  reads its own rows; context- and tensor-parallel peers read the same ones.
- **Loss**: the global token mean through ``num_items_in_batch``, scaled by the number of data
  shards (the ranks that share a batch are reported to the Trainer as ``get_tp_size()``); for a
  model that returns logits, ``core.lm_loss`` (``trainer_loss``).
- **Checkpoints**: ``save_steps`` write the trainable parameters and their optimizer state with
  DCP (``checkpoint-N/fsdp_turbo_state/``, atomic: complete or absent) beside the Trainer's own
  files, in the background with ``fsdp_turbo_async_save=True`` (training goes on while they are
  written; ``fsdp_turbo.checkpoint.TrainingCheckpointer``). ``resume_from_checkpoint`` reads them
  at any layout, and ``resume_from_checkpoint=True`` takes the last complete one. ``save_model``
  writes transformers' layout (or a PEFT adapter) without any rank holding the whole model.
- **TRL** (``trainer_trl``): where TRL's fused LM head would read around FSDPTurbo's loss
  features, ``SFTTrainer`` trains on the model's own loss and other TRL trainers are refused;
  ``DPOTrainer``'s reference model is sharded like the policy.

Everything the subclass cannot honour is refused with a ``ConfigError`` naming the
``TrainingArguments`` field and the fix, on every rank, before the model is sharded (so before
any collective of ours; ``trainer_arguments``).

Tested with transformers 5.23, accelerate 1.15 and TRL 1.16 (``TESTED_VERSIONS``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_turbo.checkpoint.training import TrainingCheckpointer, read_trainable_state
from fsdp_turbo.core.errors import CheckpointError, ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.moe_telemetry import scalars, telemetry_of
from fsdp_turbo.fsdp_turbo import FSDPTurbo, as_config
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

try:  # transformers is a dependency of the fsdp-turbo package (not of turbo-core); its Trainer needs accelerate
    import accelerate  # noqa: F401 - only to name it when missing
    import transformers
    from packaging.version import Version
    from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

    from fsdp_turbo.integrations.trainer_arguments import (
        check_async_save,
        check_trainer_inputs,
        check_training_arguments,
    )
    from fsdp_turbo.integrations.trainer_data import check_even_eval_batches, feed_data_shard
    from fsdp_turbo.integrations.trainer_loss import computes_its_loss, logits_model_loss
    from fsdp_turbo.integrations.trainer_trl import (
        adapter_first,
        check_trl_trainer,
        loss_through_model,
        warn_metrics_not_logged,
    )
except ImportError as error:
    raise ImportError(
        f"fsdp_turbo.integrations.transformers needs transformers and accelerate (tested with transformers 5.23 "
        f"and accelerate 1.15): pip install 'transformers>=5.23' 'accelerate>=1.15' ({error})") from error

__all__ = ["TESTED_VERSIONS", "FSDPTurboTrainerMixin", "check_training_arguments", "load_config", "with_fsdp_turbo"]

TESTED_VERSIONS = {"transformers": "5.23", "accelerate": "1.15", "trl": "1.16"}
# The oldest transformers whose Trainer has the switch this module sets (``is_distributed_loading_by_transformers``:
# a model that owns its placement and gradient reduction is neither moved nor wrapped by accelerate).
MIN_TRANSFORMERS = "5.23"

T = TypeVar("T", bound=type)
_log = get_logger(__name__)
_SAVE_SCRATCH = ".fsdp_turbo_save"  # save_model's scratch folder inside output_dir

ConfigLike = FSDPTurboConfig | Mapping[str, Any] | str | Path


# ----- the configuration --------------------------------------------------------------------
def load_config(value: ConfigLike | None) -> FSDPTurboConfig:
    """The ``fsdp_turbo_config=`` keyword as a config: a config, a dict of its fields, or a YAML/TOML path
    (read as ``FSDPTurbo`` reads them)."""
    return as_config(value, field="fsdp_turbo_config")


# ----- the subclass -----------------------------------------------------------------------------
def _owns_placement(self: Any) -> bool:
    return True


def _ignore_assignment(self: Any, value: Any) -> None:
    """``Trainer.__init__`` assigns the flag from the model; the subclass keeps it True."""


class FSDPTurboTrainerMixin:
    """Put before a ``transformers.Trainer`` class (``with_fsdp_turbo`` does): the model is sharded by
    ``FSDPTurbo`` in ``__init__`` and the Trainer does not move or wrap it again."""

    # Why this and not an override of _wrap_model or accelerate's prepare: transformers' Trainer (5.23) has this
    # switch for a model "sharded at load time ... the model owns its placement and gradient reduction, so
    # Accelerate must not wrap or shard it again" (set from the model in Trainer.__init__). An FSDPTurbo model is
    # exactly that. With it the Trainer: does not move the model to a device; gives it to accelerate's
    # prepare_model(evaluation_mode=True), which neither wraps it in DDP (that refuses DTensor parameters) nor
    # shards it again; defers FSDP's gradient reduction itself under gradient accumulation; keeps trainable
    # parameters that FSDP does not shard identical across ranks; and has every rank take part in saving.
    is_distributed_loading_by_transformers = property(_owns_placement, _ignore_assignment)

    def __init__(self, *args: Any, fsdp_turbo_config: ConfigLike | None = None, fsdp_turbo_async_save: bool = False,
                 **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        bound.apply_defaults()  # every parameter named, e.g. DPOTrainer's ref_model when not given
        model, training_args = bound.arguments.get("model"), bound.arguments.get("args")
        config = load_config(fsdp_turbo_config)
        # every check before FSDPTurbo, whose meshes and fully_shard are the first collectives
        check_trainer_inputs(model, training_args, bound.arguments.get("model_init"),
                              bound.arguments.get("optimizers"))
        config = check_training_arguments(training_args, config)
        check_async_save(training_args, fsdp_turbo_async_save)
        check_trl_trainer(type(self), bound.arguments, config)
        adapter_first(bound.arguments)
        bound.arguments["model"] = FSDPTurbo(config, bound.arguments["model"])
        if isinstance(bound.arguments.get("ref_model"), nn.Module):  # DPOTrainer's: sharded like the policy
            bound.arguments["ref_model"] = FSDPTurbo(config, bound.arguments["ref_model"])
        self.fsdp_turbo_config = config
        self._writing_checkpoint = False
        self._async_save = fsdp_turbo_async_save
        self._checkpointer: TrainingCheckpointer | None = None  # made at the first save (it makes a process group)
        self._loss_through_model = loss_through_model(type(self), config)
        if self._loss_through_model:
            warn_metrics_not_logged(type(self), config)
        with _checkpoints_allowed(training_args):
            super().__init__(*bound.args, **bound.kwargs)
        self._moe_telemetry = telemetry_of(bound.arguments["model"])
        self._returns_logits = not computes_its_loss(self.model)
        if self._returns_logits:  # its loss is lm_loss's (trainer_loss): the Trainer counts the step's tokens for it,
            self.model_accepts_loss_kwargs, self._loss_shifts_labels = True, True  # shifted as causal LMs shift
            if training_args.label_names is None:
                self.label_names = ["labels"]  # (the forward does not name them, so the Trainer would drop them)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """An MoE model's routing since the last training log (``core.moe_telemetry``: the busiest
        expert's load over the mean, the routers' entropy, dropped slots, per layer) joins each
        training log. Every rank logs (the loss is gathered for it), so every rank reads it."""
        if self._moe_telemetry is not None and "loss" in logs:
            logs = {**logs, **scalars(self._moe_telemetry.read(self.args.device))}
        super().log(logs, *args, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if self._returns_logits:
            loss = logits_model_loss(model, inputs, num_items_in_batch,
                                     self.accelerator.num_processes // self.get_tp_size())
            return (loss, (loss,)) if return_outputs else loss
        if self._loss_through_model:  # TRL's fused LM head would read around CP, TP or the chunked loss (trainer_trl)
            return transformers.Trainer.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                                     num_items_in_batch=num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    # ----- one batch per data shard ------------------------------------------------------------------------------
    # transformers' Trainer divides the token count and scales the loss by the ranks that share a batch, which it
    # reads as get_tp_size() x get_cp_size() x get_sp_size() (the loss scale reads get_tp_size() alone). Under
    # FSDPTurbo those are all of the world outside the data shards (CP and TP peers), and the loss scale must be the
    # data-shard count: FSDP averages over fsdp x cp, and context parallel's loss already sums the sequence over cp
    # (context_parallel.loss). So the whole factor is reported as the first, and the others as 1.
    def get_tp_size(self) -> int:
        state = self.model.parallel_state
        return state.world_size // state.dp_size

    def get_cp_size(self) -> int:
        return 1

    def get_sp_size(self) -> int:
        return 1

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> Any:
        state = self.model.parallel_state
        if not is_training:
            check_even_eval_batches(dataset, batch_size, state.dp_size, state.world_size)
        loader = super()._get_dataloader(dataset=dataset, description=description, batch_size=batch_size,
                                         sampler_fn=sampler_fn, is_training=is_training,
                                         dataloader_key=dataloader_key)
        return feed_data_shard(loader, state.dp_rank, state.dp_size, state.world_size)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # Why: with bf16, accelerate would wrap the model's forward in autocast (and cast its outputs to float32):
        # a second mixed precision over FSDP2's, which fsdp_plan.param_dtype already gives (parameters gathered and
        # computed in bf16, as in FSDPTurbo's own loop). bf16 was checked against param_dtype before sharding.
        return {**super()._build_accelerator_args(**kwargs), "mixed_precision": "no"}

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        # Why: under gradient accumulation the Trainer defers the reduction of a model sharded at load time, reading
        # that model's config.distributed_config (from_pretrained(distributed_config=...)), which an FSDPTurbo model
        # has not. Nothing is deferred here: gradients reduce-scatter after every micro-batch and accumulate sharded,
        # as in FSDPTurbo's own loop (deferring would hold whole, unsharded gradients between micro-batches).
        yield

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        # Why: a forward without backward leaves FSDP2's units that keep their parameters after forward (the root,
        # fsdp_plan.keep_after_forward) gathered, whole on every rank, until the next backward. Evaluation and
        # prediction (both run this loop) end with every unit sharded again: the memory is given back, and the
        # parameters are the DTensor shards that the optimizer step and save_model read.
        output = super().evaluation_loop(*args, **kwargs)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model in transformers' layout (a PEFT model: its adapter) into ``output_dir``, with the
        processing class and the training arguments, as ``Trainer.save_model`` does. A collective: call it on
        every rank (``Trainer.train`` does)."""
        # Why: the Trainer's own _save gathers the whole state_dict on every rank and writes it from one;
        # fsdp_turbo.checkpoint.save_pretrained writes one file at a time, each from the rank that gathers it.
        # It publishes a whole folder (replacing it), so it writes a scratch folder inside output_dir, whose
        # files then join what output_dir already holds (logs, other checkpoints), as save_pretrained's would.
        if self._writing_checkpoint and not self.args.save_only_model:
            return  # a save_steps checkpoint: the model goes in sharded, with its optimizer state (below)
        from fsdp_turbo.checkpoint import save_pretrained

        output_dir = Path(output_dir if output_dir is not None else self.args.output_dir)
        scratch = save_pretrained(self.model, output_dir / _SAVE_SCRATCH)
        if self.is_world_process_zero():
            for written in scratch.iterdir():
                os.replace(written, output_dir / written.name)
            scratch.rmdir()
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, output_dir / TRAINING_ARGS_NAME)
        self.accelerator.wait_for_everyone()  # every rank returns once the folder is complete
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ----- save_steps checkpoints: DCP-sharded, beside the Trainer's own state files ------------------------------
    # Why: the Trainer's checkpoint of a model that owns its sharding would be whole weights on one rank and no
    # optimizer state (transformers refuses it). Here checkpoint-N/ holds the trainable parameters and their
    # optimizer state in DCP (each rank writes its shards; any later layout or data-parallel size reads them),
    # and everything else the Trainer writes there as usual: scheduler, RNG states, trainer_state.json.
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._writing_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._writing_checkpoint = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        meta = {"global_step": self.state.global_step}
        self.fsdp_turbo_checkpointer().save(Path(output_dir) / SHARDED_STATE, self.model, self.optimizer, meta)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def fsdp_turbo_checkpointer(self) -> TrainingCheckpointer:
        """What writes the sharded state of each ``save_steps`` checkpoint (collective on first call)."""
        if self._checkpointer is None:
            self._checkpointer = TrainingCheckpointer(async_save=self._async_save, device=self.args.device.type,
                                                      timeout_s=self.args.ddp_timeout)
        return self._checkpointer

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the last checkpoint whose sharded state is
        complete (a save that a crash or a failure cut short is passed over, with a warning). It returns once the
        last checkpoint is complete on disk."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = str(last_complete_checkpoint(self.args.output_dir))
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        if self._checkpointer is not None:
            self._checkpointer.wait()
        return output

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Only checked here: the parameters are read with their optimizer state, once the optimizer exists.
        _sharded_state(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        read_trainable_state(_sharded_state(checkpoint), self.model, self.optimizer)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if scheduler.is_file():  # weights_only: a checkpoint is data
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()  # the best may be the save still in flight
        read_trainable_state(_sharded_state(self.state.best_model_checkpoint), self.model, None)


SHARDED_STATE = "fsdp_turbo_state"  # the DCP folder inside a Trainer checkpoint-N/


def _has_sharded_state(checkpoint: str | os.PathLike) -> bool:
    """Whether ``checkpoint`` (a checkpoint-N folder) holds its complete sharded state: the
    checkpointer renames the folder into place only once every rank's shards are in."""
    return (Path(checkpoint) / SHARDED_STATE / ".metadata").is_file()


def _sharded_state(checkpoint: str | os.PathLike) -> Path:
    folder = Path(checkpoint) / SHARDED_STATE
    if not _has_sharded_state(checkpoint):
        raise CheckpointError("resume_from_checkpoint", str(checkpoint), "resume from a checkpoint-N folder "
                              "written by a with_fsdp_turbo Trainer (its save_steps), or start without it",
                              reason=f"it has no {SHARDED_STATE}/ (the model and optimizer state, sharded)")
    return folder


def _step_of(folder: Path) -> int | None:
    number = folder.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
    return int(number) if number.isdigit() and folder.is_dir() else None


def last_complete_checkpoint(output_dir: str | os.PathLike) -> Path:
    """The ``checkpoint-N`` folder of ``output_dir`` with the largest N whose sharded state is complete; newer ones
    (a save cut short: only ``fsdp_turbo_state.partial/``) are named in one warning."""
    found = sorted((step, folder) for folder in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*")
                   if (step := _step_of(folder)) is not None)
    complete = [(step, folder) for step, folder in found if _has_sharded_state(folder)]
    if not complete:
        raise CheckpointError("resume_from_checkpoint", True, "start without resume_from_checkpoint, or name a "
                              "checkpoint-N folder", reason=f"{output_dir} has no checkpoint-N folder whose "
                              f"{SHARDED_STATE}/ is complete")
    last_step, last = complete[-1]
    cut_short = [folder.name for step, folder in found if step > last_step]
    if cut_short:
        _log.warning(f"resuming from {last.name}: {', '.join(cut_short)} did not finish writing their "
                     f"{SHARDED_STATE}/ (a save cut short by a crash or a failure)")
    return last


@contextlib.contextmanager
def _checkpoints_allowed(args: Any) -> Iterator[None]:
    """``Trainer.__init__`` refuses save_steps checkpoints for a model that owns its sharding (it could not save
    its optimizer state); this subclass saves them (above), so the check sees save_strategy 'no' for its duration."""
    strategy = args.save_strategy
    args.save_strategy = SaveStrategy.NO
    try:
        yield
    finally:
        args.save_strategy = strategy


def _check_transformers_version() -> None:
    installed = transformers.__version__
    if Version(installed).release < Version(MIN_TRANSFORMERS).release:
        raise ConfigError("transformers", installed, f"pip install 'transformers>={MIN_TRANSFORMERS}'",
                          reason="its Trainer has no switch for a model that owns its sharding, so accelerate "
                                 "would wrap the FSDPTurbo model again")


def with_fsdp_turbo(trainer_cls: T) -> T:
    """A subclass of ``trainer_cls`` (``transformers.Trainer`` or any subclass, e.g. TRL's trainers) that takes
    ``fsdp_turbo_config=`` (an ``FSDPTurboConfig``, a dict of its fields, or a YAML/TOML path) and trains the
    model through ``FSDPTurbo``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise ConfigError("trainer_cls", getattr(trainer_cls, "__name__", trainer_cls),
                          "pass transformers.Trainer or a subclass of it (e.g. trl.SFTTrainer)")
    if issubclass(trainer_cls, FSDPTurboTrainerMixin):
        raise ConfigError("trainer_cls", trainer_cls.__name__, f"pass the original trainer class; "
                          f"{trainer_cls.__name__} already comes from with_fsdp_turbo")
    _check_transformers_version()
    name = f"FSDPTurbo{trainer_cls.__name__}"
    return type(name, (FSDPTurboTrainerMixin, trainer_cls), {"__module__": __name__, "__qualname__": name,
                                                             "__doc__": with_fsdp_turbo.__doc__})
