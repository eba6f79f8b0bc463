"""transformers' ``Trainer`` on FSDPTurbo: ``with_fsdp_turbo(Trainer)`` returns a subclass.

    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    trainer = with_fsdp_turbo(Trainer)(model=model, args=args, train_dataset=ds,
                                       fsdp_turbo_config=FSDPTurboConfig(...))  # or a dict, or a YAML/TOML path
    trainer.train()

The script is otherwise unchanged and launched with ``torchrun``. The subclass applies
``FSDPTurbo(config, model)`` once, in its ``__init__``, before accelerate sees the model, and
tells the Trainer that the model owns its placement and gradient reduction, so accelerate
neither moves it nor wraps it again (no DDP, no second FSDP). Everything else is the
Trainer's own: its data loader (each rank a data shard), its loss scaling by
``num_items_in_batch`` (the global token mean), its optimizer, scheduler, clipping (one norm
over the DTensor gradients), logging and callbacks.

Everything the subclass cannot honour is refused with a ``ConfigError`` naming the
``TrainingArguments`` field and the fix, on every rank, before the model is sharded (so before
any collective of ours).

Tested with transformers 5.23 and accelerate 1.15 (``TESTED_VERSIONS``).
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

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.fsdp_turbo import FSDPTurbo, as_config
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

try:  # transformers is a dependency of the fsdp-turbo package (not of turbo-core); its Trainer needs accelerate
    import accelerate  # noqa: F401 - only to name it when missing
    import transformers
    from packaging.version import Version
    from transformers.trainer import TRAINING_ARGS_NAME
except ImportError as error:
    raise ImportError(
        f"fsdp_turbo.integrations.transformers needs transformers and accelerate (tested with transformers 5.23 "
        f"and accelerate 1.15): pip install 'transformers>=5.23' 'accelerate>=1.15' ({error})") from error

__all__ = ["TESTED_VERSIONS", "FSDPTurboTrainerMixin", "check_training_arguments", "load_config", "with_fsdp_turbo"]

TESTED_VERSIONS = {"transformers": "5.23", "accelerate": "1.15"}
# The oldest transformers whose Trainer has the switch this module sets (``is_distributed_loading_by_transformers``:
# a model that owns its placement and gradient reduction is neither moved nor wrapped by accelerate).
MIN_TRANSFORMERS = "5.23"

T = TypeVar("T", bound=type)
_SAVE_SCRATCH = ".fsdp_turbo_save"  # save_model's scratch folder inside output_dir

ConfigLike = FSDPTurboConfig | Mapping[str, Any] | str | Path


# ----- the configuration --------------------------------------------------------------------
def load_config(value: ConfigLike | None) -> FSDPTurboConfig:
    """The ``fsdp_turbo_config=`` keyword as a config: a config, a dict of its fields, or a YAML/TOML path
    (read as ``FSDPTurbo`` reads them)."""
    return as_config(value, field="fsdp_turbo_config")


# ----- refusals: what the Trainer would do beside FSDPTurbo -------------------------------------
# TrainingArguments fields that ask the Trainer (or accelerate) for a feature FSDPTurbo's config owns.
# (transformers 5 renamed gradient_checkpointing to activation_checkpointing; either sets both.)
_OWNED_BY_CONFIG = {
    "gradient_checkpointing": "set gradient_checkpointing=False (activation_checkpointing=False) and turn on the "
                              "FSDPTurbo config's recompute=True (recompute_plan and recompute_policy pick the "
                              "blocks and what is kept)",
    "activation_checkpointing": "set activation_checkpointing=False and turn on the FSDPTurbo config's "
                                "recompute=True (recompute_plan and recompute_policy pick the blocks and what is kept)",
    "torch_compile": "set torch_compile=False and turn on the FSDPTurbo config's compile=True "
                     "(compile_plan and compile_backend pick the blocks and the backend)",
}
# Fields that ask for another sharding or parallelism of the model; FSDPTurbo's config is the one layout.
_OTHER_LAYOUTS = {
    "deepspeed": "drop deepspeed from TrainingArguments: FSDPTurbo shards the model (fsdp_turbo_config)",
    "fsdp": "drop fsdp (and fsdp_config) from TrainingArguments: FSDPTurbo shards the model (fsdp_turbo_config's "
            "fully_shard_parallel_size and fsdp_plan)",
    "parallelism_config": "drop parallelism_config from TrainingArguments: give the sizes in fsdp_turbo_config "
                          "(fully_shard_parallel_size, tensor_parallel_size, context_parallel_size, ...)",
}
# accelerate launch's switches, read by the Accelerator from the environment behind TrainingArguments' back.
_LAUNCHER_ENV = {"ACCELERATE_USE_FSDP": "fsdp", "ACCELERATE_USE_DEEPSPEED": "deepspeed"}


def _refuse_owned_features(args: Any) -> None:
    for name, fix in _OWNED_BY_CONFIG.items():
        if getattr(args, name, False):
            raise ConfigError(f"TrainingArguments.{name}", getattr(args, name), fix,
                              reason="with_fsdp_turbo applies this through the FSDPTurbo config, once")


def _shown(value: Any) -> Any:
    """A field's value for an error message: plain values as they are, objects by their class."""
    return value if isinstance(value, str | int | float | list | tuple | dict) else f"{type(value).__name__}(...)"


def _refuse_other_layouts(args: Any) -> None:
    for name, fix in _OTHER_LAYOUTS.items():
        if getattr(args, name, None):  # None, "" and [] are unset
            raise ConfigError(f"TrainingArguments.{name}", _shown(getattr(args, name)), fix,
                              reason="the model is sharded by FSDPTurbo and must not be wrapped again")
    for variable, name in _LAUNCHER_ENV.items():
        if os.environ.get(variable, "false").strip().lower() in ("1", "true"):
            raise ConfigError(f"${variable}", os.environ[variable], f"launch with torchrun, or accelerate launch "
                              f"without its {name} options: {_OTHER_LAYOUTS[name]}",
                              reason="the model is sharded by FSDPTurbo and must not be wrapped again")


def _precision_source(args: Any) -> tuple[str, Any]:
    """Where the Trainer's mixed precision comes from, and its value: its bf16/fp16 field, else accelerate
    launch's environment."""
    for name in ("bf16", "fp16"):
        if getattr(args, name, False):
            return f"TrainingArguments.{name}", True
    return "$ACCELERATE_MIXED_PRECISION", os.environ.get("ACCELERATE_MIXED_PRECISION")


def _check_mixed_precision(args: Any, config: FSDPTurboConfig) -> None:
    """Mixed precision comes from ``fsdp_plan.param_dtype``: the Trainer's (bf16, fp16, or accelerate launch's
    ``--mixed_precision``, all in ``args.mixed_precision``) must say the same."""
    asked = getattr(args, "mixed_precision", "no") or "no"
    param_dtype = config.fsdp_plan.param_dtype
    param_dtype = None if param_dtype == torch.float32 else param_dtype
    if asked == "fp16":
        raise ConfigError(*_precision_source(args), "use bf16=True with fsdp_plan.param_dtype='bfloat16'",
                          reason="fp16 needs a loss scaler, which with_fsdp_turbo does not set up for sharded "
                                 "gradients")
    if asked == "bf16" and param_dtype != torch.bfloat16:
        raise ConfigError(*_precision_source(args), "set fsdp_plan.param_dtype='bfloat16' in the FSDPTurbo config "
                          "(mixed precision comes from fsdp_plan), or drop bf16",
                          reason=f"fsdp_plan.param_dtype is {param_dtype}")
    if asked == "no" and param_dtype is not None:
        shown = str(param_dtype).removeprefix("torch.")
        fix = ("set bf16=True in TrainingArguments too, or unset fsdp_plan.param_dtype"
               if param_dtype == torch.bfloat16 else "use 'bfloat16' (with bf16=True), or unset it")
        raise ConfigError("fsdp_plan.param_dtype", shown, fix,
                          reason="TrainingArguments ask for no mixed precision (bf16 is False)")


def _refuse_checkpoints(args: Any) -> None:
    # Trainer checkpoints (save_steps) of a sharded model are a later slice: the Trainer itself refuses them for a
    # model that owns its sharding, with a message about from_pretrained(distributed_config=...). Say it here.
    strategy = getattr(getattr(args, "save_strategy", "no"), "value", getattr(args, "save_strategy", "no"))
    if strategy != "no":
        raise ConfigError("TrainingArguments.save_strategy", strategy,
                          "set save_strategy='no' and save the trained model with trainer.save_model(path) "
                          "after trainer.train(), on every rank",
                          reason="Trainer checkpoints of an FSDPTurbo model are not supported yet")


def _check_data_layout(args: Any, config: FSDPTurboConfig) -> None:
    # The Trainer's data loader (accelerate's) gives each process its own batch: right when every rank is its own
    # data shard, as under FSDP and HSDP. CP and TP peers must see the same batch: not wired to the Trainer yet.
    sizes = config.validate(args.world_size)
    if sizes.dp_replicate_x_fsdp != args.world_size:
        field = next((f for f in ("context_parallel_size", "tensor_parallel_size") if getattr(config, f) > 1),
                     "fully_shard_parallel_size")
        value = getattr(config, field)
        raise ConfigError(field, value, f"set {field}=1 (FSDP and HSDP over the {args.world_size} ranks work)",
                          reason="with_fsdp_turbo gives each rank its own batch; context and tensor parallel "
                                 "peers sharing one batch are not supported with the Trainer yet")


def check_training_arguments(args: Any, config: FSDPTurboConfig) -> None:
    """Refuse the ``TrainingArguments`` that FSDPTurbo cannot honour beside ``config``. No collectives."""
    _refuse_owned_features(args)
    _refuse_other_layouts(args)
    _check_mixed_precision(args, config)
    _refuse_checkpoints(args)
    _check_data_layout(args, config)


def _check_trainer_inputs(model: Any, args: Any, model_init: Any, optimizers: Any) -> None:
    if optimizers and optimizers[0] is not None:
        raise ConfigError("optimizers", f"({type(optimizers[0]).__name__}, ...)",
                          "let the Trainer build the optimizer (TrainingArguments.optim, learning_rate, ...), or "
                          "pass optimizer_cls_and_kwargs=(cls, kwargs)",
                          reason="an optimizer made before the Trainer holds the model's unsharded parameters, "
                                 "which FSDPTurbo replaces with their shards")
    if model_init is not None:
        raise ConfigError("model_init", getattr(model_init, "__name__", model_init),
                          "build the model yourself and pass model=; it is sharded once, in the Trainer's __init__",
                          reason="with_fsdp_turbo does not re-create and re-shard models (hyperparameter search)")
    if not isinstance(model, nn.Module):
        raise ConfigError("model", model if isinstance(model, str) else type(model).__name__,
                          "load the model yourself (e.g. AutoModelForCausalLM.from_pretrained(...)) and pass it")
    if args is None:
        raise ConfigError("args", None, "pass args=TrainingArguments(...) (or the trainer's config class)",
                          reason="the arguments are checked against the FSDPTurbo config before sharding")


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

    def __init__(self, *args: Any, fsdp_turbo_config: ConfigLike | None = None, **kwargs: Any) -> None:
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        model, training_args = bound.arguments.get("model"), bound.arguments.get("args")
        config = load_config(fsdp_turbo_config)
        # every check before FSDPTurbo, whose meshes and fully_shard are the first collectives
        _check_trainer_inputs(model, training_args, bound.arguments.get("model_init"),
                              bound.arguments.get("optimizers"))
        check_training_arguments(training_args, config)
        bound.arguments["model"] = FSDPTurbo(config, model)
        self.fsdp_turbo_config = config
        super().__init__(*bound.args, **bound.kwargs)

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
