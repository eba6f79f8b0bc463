"""TRL's trainers on FSDPTurbo: where they compute around the model, and what that means per layout.

TRL (1.16) patches the model's forward with a "fused LM head" (``trl.trainer.utils.add_fused_lm_head``):
called with ``fused_lm_head=True`` it runs the backbone, then the output head's whole (gathered) weight
over the positions that carry a label, and returns per-token log-probabilities; the trainer computes
its loss from those. That reads the model around FSDPTurbo's loss features:

- under context parallel, each rank's log-probabilities cover its chunk of the sequence, and the sum
  over the CP group that FSDPTurbo adds to the model's own loss is not applied to TRL's;
- under tensor parallel, the head's input is still split by sequence (sequence parallel) and its
  logits by vocabulary (loss parallel);
- the chunked loss never runs.

So:

- ``SFTTrainer`` at those layouts trains on the model's own loss (``transformers.Trainer.compute_loss``:
  ``model(**inputs)`` with its labels and ``num_items_in_batch``), which each feature makes the global
  token mean; the same loss TRL's ``loss_type="nll"`` computes. What TRL computes only from its fused
  head (its ``entropy`` and ``mean_token_accuracy`` metrics, ``num_tokens``) is not logged, and one
  rank-0 warning says so. The loss types and options that need the whole logits are refused.
- Other TRL trainers (``DPOTrainer`` and the rest compute sequence log-probabilities from the fused
  head) are refused at those layouts; FSDP, HSDP and expert parallel run them unchanged.
- ``peft_config=`` is applied before the model is sharded (``peft.get_peft_model``), so FSDPTurbo
  shards the PEFT model; TRL then receives that model and no ``peft_config``.
- ``DPOTrainer``'s reference model is sharded by FSDPTurbo with the policy's config; without one (and
  without a PEFT policy, whose reference is the adapter switched off) TRL would load a second, unsharded
  copy from ``config._name_or_path``, so one must be passed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

__all__ = ["adapter_first", "check_trl_trainer", "loss_through_model", "warn_metrics_not_logged"]

_log = get_logger(__name__)

# What the fused head computes that the model's own loss does not.
FUSED_HEAD_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def is_trl_trainer(trainer_cls: type) -> bool:
    return any(base.__module__.split(".")[0] == "trl" for base in trainer_cls.__mro__)


def _is_sft_trainer(trainer_cls: type) -> bool:
    from trl import SFTTrainer  # only reached for TRL trainers, so TRL is installed

    return issubclass(trainer_cls, SFTTrainer)


def _layout_around_the_head(config: FSDPTurboConfig) -> tuple[str, Any] | None:
    """The first config field whose feature the fused head reads around, with its value; None if none is on."""
    for field in ("context_parallel_size", "tensor_parallel_size"):
        if getattr(config, field) > 1:
            return field, getattr(config, field)
    if config.chunk_loss:
        return "chunk_loss", True
    return None


def loss_through_model(trainer_cls: type, config: FSDPTurboConfig) -> bool:
    """Whether ``compute_loss`` must use the model's own loss instead of TRL's fused head."""
    return is_trl_trainer(trainer_cls) and _layout_around_the_head(config) is not None


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def _check_sft_arguments(args: Any, field: str, compute_loss_func: Any) -> None:
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type != "nll":
        raise ConfigError("SFTConfig.loss_type", loss_type, f"use loss_type='nll', or drop {field}",
                          reason=f"under {field} SFTTrainer trains on the model's own loss (token-mean NLL)")
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ConfigError("SFTConfig.label_smoothing_factor", args.label_smoothing_factor,
                          f"set it to 0, or drop {field}", reason="label smoothing reads the whole logits")
    if compute_loss_func is not None:
        raise ConfigError("compute_loss_func", getattr(compute_loss_func, "__name__", "..."),
                          f"drop it, or drop {field}", reason="it reads the whole logits")


def check_trl_trainer(trainer_cls: type, arguments: dict[str, Any], config: FSDPTurboConfig) -> None:
    """Refuse what a TRL trainer cannot do beside ``config``, before the model is sharded."""
    if not is_trl_trainer(trainer_cls):
        return
    around = _layout_around_the_head(config)
    if around is not None:
        field, value = around
        if not _is_sft_trainer(trainer_cls):
            raise ConfigError(field, value, f"train {trainer_cls.__name__} with FSDP, HSDP and expert parallel only "
                              f"(set {field} off)", reason=f"{trainer_cls.__name__} computes sequence "
                              "log-probabilities with TRL's fused LM head, on whole sequences and the whole head")
        _check_sft_arguments(arguments.get("args"), field, arguments.get("compute_loss_func"))
    if "ref_model" in arguments:  # (the arguments name every parameter, given or not)
        model, reference = arguments.get("model"), arguments.get("ref_model")
        if reference is None and not _is_peft(model):
            raise ConfigError("ref_model", None, "pass ref_model= (the same model loaded again, e.g. "
                              "AutoModelForCausalLM.from_pretrained(path)); with_fsdp_turbo shards it like the policy",
                              reason=f"{trainer_cls.__name__} would load an unsharded reference model itself")
        if reference is not None and not isinstance(reference, nn.Module):
            raise ConfigError("ref_model", reference if isinstance(reference, str) else type(reference).__name__,
                              "load the reference model yourself and pass it")


def warn_metrics_not_logged(trainer_cls: type, config: FSDPTurboConfig) -> None:
    field, _ = _layout_around_the_head(config)
    _log.warning(f"{trainer_cls.__name__} under {field}: trains on the model's own loss; TRL's "
                 f"{', '.join(FUSED_HEAD_METRICS)} metrics are not logged (TRL computes them from its fused LM head, "
                 "which reads the whole, unsplit logits)")


def adapter_first(arguments: dict[str, Any]) -> None:
    """A TRL trainer's ``peft_config=`` applied to ``arguments['model']`` now, before FSDPTurbo shards it (TRL would
    apply it in its ``__init__``, to a model already sharded without its adapters)."""
    peft_config = arguments.get("peft_config")
    if peft_config is None:
        return
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise ConfigError("peft_config", type(peft_config).__name__, "pass a peft.PeftConfig (e.g. peft.LoraConfig)")
    if _is_peft(arguments.get("model")):
        raise ConfigError("peft_config", type(peft_config).__name__, "pass either a PEFT model or a peft_config",
                          reason="the model already has adapters")
    # the adapters' random init as in the plain script: there the Trainer seeds first, then TRL adds them
    args = arguments.get("args")
    if args is not None:
        from transformers.trainer_utils import enable_full_determinism, set_seed

        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
    arguments["model"] = get_peft_model(arguments["model"], peft_config)
    arguments["peft_config"] = None
