"""What ``with_fsdp_turbo`` checks before ``FSDPTurbo`` shards the model (so before any collective):
``TrainingArguments`` that ask the Trainer or accelerate for a feature the FSDPTurbo config owns (applied
through the config instead, or refused where the config has it too), or for a second layout of the model,
and Trainer inputs it cannot honour. Each is a ``ConfigError`` naming the field
and the fix, raised alike on every rank (the checks read only the arguments and the config)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

__all__ = ["adopt_mixed_precision", "adopt_owned_features", "check_trainer_inputs", "check_training_arguments"]

_log = get_logger(__name__)


# ----- what the Trainer would do beside FSDPTurbo -------------------------------------------------------
# TrainingArguments fields that ask the Trainer (or accelerate) for a feature FSDPTurbo's config owns: each is
# applied as that config field (its default plan), or refused when the config turns the feature on too.
# (transformers 5 renamed gradient_checkpointing to activation_checkpointing; either sets both. TRL's configs turn
# it on by default.)
_OWNED_BY_CONFIG = {
    "gradient_checkpointing": ("recompute", "activation_checkpointing"),
    "activation_checkpointing": ("recompute", "gradient_checkpointing"),
    "torch_compile": ("compile", None),
}


def adopt_owned_features(args: Any, config: FSDPTurboConfig) -> FSDPTurboConfig:
    """``config`` with the features ``args`` asks the Trainer for turned on in it instead (a rank-0 warning names
    each); the Trainer's own switches are turned off, so each feature is applied once, by FSDPTurbo."""
    for name, (field, alias) in _OWNED_BY_CONFIG.items():
        if not getattr(args, name, False):
            continue
        if getattr(config, field):
            raise ConfigError(f"TrainingArguments.{name}", True, f"set {name}=False and keep the FSDPTurbo "
                              f"config's {field}=True (its {field}_plan picks the blocks)",
                              reason=f"the FSDPTurbo config turns {field} on too; it must be applied once")
        config = replace(config, **{field: True})
        if field == "compile" and getattr(args, "torch_compile_backend", None):
            config = replace(config, compile_backend=args.torch_compile_backend)
        _log.warning(f"TrainingArguments.{name}=True is applied as the FSDPTurbo config's {field}=True "
                     f"({field}_plan: the model's repeated blocks); the Trainer's own is turned off")
        for switch in (name, alias):
            if switch is not None and hasattr(args, switch):
                setattr(args, switch, False)
    return config


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


def adopt_mixed_precision(args: Any, config: FSDPTurboConfig) -> FSDPTurboConfig:
    """Mixed precision comes from ``fsdp_plan.param_dtype``; the Trainer's (bf16, fp16, or accelerate launch's
    ``--mixed_precision``, all in ``args.mixed_precision``) must say the same. Where the config leaves
    ``param_dtype`` unset, the Trainer's bf16 is adopted as ``param_dtype='bfloat16'`` with gradients reduced in
    float32 (a rank-0 warning says so): TRL's configs ask for bf16 by default. Only a real conflict is an error."""
    asked = getattr(args, "mixed_precision", "no") or "no"
    given = config.fsdp_plan.param_dtype
    if asked == "fp16":
        raise ConfigError(*_precision_source(args), "use bf16=True with fsdp_plan.param_dtype='bfloat16'",
                          reason="fp16 needs a loss scaler, which with_fsdp_turbo does not set up for sharded "
                                 "gradients")
    if asked == "bf16" and given is None:
        reduce_dtype = config.fsdp_plan.reduce_dtype or torch.float32
        _log.warning(f"{_precision_source(args)[0]}=True is applied as the FSDPTurbo config's fsdp_plan.param_dtype="
                     f"'bfloat16' (gradients reduced in {str(reduce_dtype).removeprefix('torch.')}): FSDP gathers and "
                     "computes in bf16 over float32 master weights; accelerate's own autocast stays off")
        return replace(config, fsdp_plan=replace(config.fsdp_plan, param_dtype=torch.bfloat16,
                                                 reduce_dtype=reduce_dtype))
    if asked == "bf16" and given != torch.bfloat16:
        raise ConfigError(*_precision_source(args), "set fsdp_plan.param_dtype='bfloat16' in the FSDPTurbo config "
                          "(or leave it unset: bf16 is then adopted), or drop bf16",
                          reason=f"fsdp_plan.param_dtype is {given}, another precision than the Trainer's")
    if asked == "no" and given not in (None, torch.float32):
        shown = str(given).removeprefix("torch.")
        fix = ("set bf16=True in TrainingArguments too, or unset fsdp_plan.param_dtype"
               if given == torch.bfloat16 else "use 'bfloat16' (with bf16=True), or unset it")
        raise ConfigError("fsdp_plan.param_dtype", shown, fix,
                          reason="TrainingArguments ask for no mixed precision (bf16 is False)")
    return config


def check_training_arguments(args: Any, config: FSDPTurboConfig) -> FSDPTurboConfig:
    """Refuse the ``TrainingArguments`` that FSDPTurbo cannot honour beside ``config``; return the config with the
    features and the precision the arguments ask for (``adopt_owned_features``, ``adopt_mixed_precision``). No
    collectives."""
    _refuse_other_layouts(args)
    if config.pipeline_parallel_size > 1:
        raise ConfigError("pipeline_parallel_size", config.pipeline_parallel_size,
                          "train a pipelined model through fsdp-turbo train or model.fsdp_turbo_pipeline.step, "
                          "or set it to 1",
                          reason="the Trainer calls the model's forward for each batch; a pipeline runs a schedule")
    config = adopt_owned_features(args, config)
    return adopt_mixed_precision(args, config)


def check_async_save(args: Any, async_save: bool) -> None:
    """Refuse background checkpoints that would leave no complete checkpoint behind a failed save. No collectives."""
    if not isinstance(async_save, bool):
        raise ConfigError("fsdp_turbo_async_save", async_save, "pass True or False")
    if async_save and args.save_total_limit == 1:
        raise ConfigError("save_total_limit", 1, "set save_total_limit to 2 or more (or leave it unset), or save "
                          "synchronously (fsdp_turbo_async_save=False)",
                          reason="the Trainer deletes the previous checkpoint as soon as the next one begins, so "
                                 "while that one is written in the background no complete checkpoint would exist")


def check_trainer_inputs(model: Any, args: Any, model_init: Any, optimizers: Any) -> None:
    """Refuse the Trainer's own inputs that ``with_fsdp_turbo`` cannot shard. No collectives."""
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

