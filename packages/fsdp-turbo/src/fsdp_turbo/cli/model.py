"""Building the job's model and exporting it back to the Hugging Face format."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.cli.job_config import ModelSection
from fsdp_turbo.core.dtypes import parse_dtype


def hf_config(section: ModelSection):
    from transformers import AutoConfig

    if section.model_name_or_path is not None:
        return AutoConfig.from_pretrained(section.model_name_or_path)
    fields = dict(section.config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(section: ModelSection, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Random init from the config dict (seeded: every rank builds the same weights), or a
    local checkpoint (safetensors only)."""
    from transformers import AutoModelForCausalLM

    dtype = parse_dtype(section.dtype, "model.dtype")
    if section.model_name_or_path is not None:
        return AutoModelForCausalLM.from_pretrained(section.model_name_or_path, dtype=dtype, use_safetensors=True)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(section), dtype=dtype)


def export_hf(model: nn.Module, section: ModelSection, directory: str | Path) -> Path | None:
    """Gather the full weights (a collective: every rank calls it) and write ``config.json``
    plus ``model.safetensors`` on rank 0, loadable by ``AutoModelForCausalLM.from_pretrained``."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # The job's own config, not the live one (features may have changed its attention name).
    config = hf_config(section)
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    config.save_pretrained(directory)
    tensors, seen = {}, {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        if tensor.data_ptr() in seen and config.tie_word_embeddings:
            continue  # a tied weight is stored once, as HF does
        seen[tensor.data_ptr()] = name
        tensors[name] = tensor.clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
