"""The job's model: built on the meta device, then given weights once FSDPTurbo has sharded it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from fsdp_turbo.checkpoint import LoadReport, init_weights, load_pretrained
from fsdp_turbo.cli.job_config import ModelSection, PeftSection
from fsdp_turbo.core.dtypes import parse_dtype
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.patterns import match_modules


def hf_config(section: ModelSection):
    """The model's HF config: from the local folder (never the hub: the job does not
    download, and the section has checked the folder), or built from ``model.config``."""
    from transformers import AutoConfig

    if section.model_name_or_path is not None:
        return AutoConfig.from_pretrained(section.model_name_or_path, local_files_only=True)
    fields = dict(section.config)
    return AutoConfig.for_model(_known_model_type(fields.pop("model_type")), **fields)


def stated_vocab_size(section: ModelSection) -> int | None:
    """The model's ``vocab_size`` where the job's ``model.config`` or the folder's
    ``config.json`` states it at the top level, read without transformers; else None (then
    ``hf_config``'s). The launcher's data check needs only this number, and building the
    config would import the model family and transformers' loading stack: 2 s of CPU a
    launch on the suite's machine, for a process that never builds the model."""
    if section.config is not None:
        fields = section.config
    else:
        path = Path(section.model_name_or_path) / "config.json"
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # hf_config reads it and names what is wrong
    size = fields.get("vocab_size") if isinstance(fields, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _known_model_type(model_type: str) -> str:
    """``model_type`` when this transformers knows it (its own error lists every type it has)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ConfigError("model.config.model_type", model_type, "name a model type this transformers "
                          "knows, e.g. 'llama', 'qwen3' or 'qwen3_moe' (or upgrade transformers)")
    return model_type


def build_model(section: ModelSection, peft: PeftSection | None = None) -> nn.Module:
    """The model on the meta device: its structure, no storage. No rank ever holds it whole.
    With ``peft``, wrapped by PEFT (its adapters on the meta device too)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(section), dtype=parse_dtype(section.dtype, "model.dtype"))
        return model if peft is None else wrap_peft(model, peft)


def wrap_peft(model: nn.Module, section: PeftSection) -> nn.Module:
    """``get_peft_model`` with the section's LoRA settings. Its module patterns are resolved with
    the library's own matcher, so the job file speaks one pattern language, and handed to PEFT
    as exact names."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError("peft", section.method, "pip install 'fsdp-turbo[peft]'",
                          reason="the peft package is not installed") from None
    targets = (sorted(match_modules(model, section.target_modules, field="peft.target_modules"))
               if section.target_modules else None)
    config = LoraConfig(r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, target_modules=targets,
                        target_parameters=list(section.target_parameters) or None)
    return get_peft_model(model, config)


def fill_weights(model: nn.Module, section: ModelSection, seed: int) -> LoadReport | None:
    """The checkpoint at ``model_name_or_path`` (each rank reads its slices), or, for a model
    given by its config, ``init_weights`` (the same weights at every layout). A collective."""
    if section.model_name_or_path is not None:
        return load_pretrained(model, section.model_name_or_path)
    init_weights(model, seed=seed)
    return None
