"""The few Hugging Face transformers entry points feature packages use, in one place.

transformers is optional (``turbo-core[hf]``) and imported lazily, only when a feature works
on an HF model; feature packages reach it through here and never import it themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


def register_attention_function(name: str, function: Callable[..., Any]) -> None:
    """Make ``function`` selectable as ``config._attn_implementation = name``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def register_attention_mask(name: str, like: str = "sdpa") -> None:
    """Make the models built for ``config._attn_implementation = name`` build the 4-D mask they
    build for ``like`` (without a mask function of its own, an unknown name gets ``None``)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[like])


def attention_function(name: str, module: nn.Module) -> Callable[..., Any]:
    """The core attention an HF attention ``module`` runs for implementation ``name``."""
    if name == "eager":
        return eager_attention_function(module)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_function(module))


def eager_attention_function(module: nn.Module) -> Callable[..., Any]:
    """The eager attention of ``module``'s own modeling file (some models special-case it)."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:  # a modeling file without one: the reference eager attention
        from transformers.models.llama.modeling_llama import eager_attention_forward as found
    return found


# ----- checkpoints: the layout transformers' own save_pretrained writes ---------------------------
def saved_state(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` less what transformers' ``save_pretrained`` leaves out: the model's
    ``_keys_to_ignore_on_save`` and the second name of each tied weight."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = {k: v for k, v in state.items() if k not in set(getattr(model, "_keys_to_ignore_on_save", None) or ())}
    return remove_tied_weights_from_state_dict(state, model)


def to_checkpoint_layout(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The model's tensors under the names and shapes its checkpoints use (transformers'
    ``revert_weight_conversion``: e.g. fused MoE experts back to one tensor per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state))


def split_into_files(tensors: dict[str, Any], max_shard_size: int | str) -> Any:
    """``huggingface_hub``'s split of a state dict into ``model-0000i-of-0000N.safetensors``
    files of at most ``max_shard_size`` (as transformers' ``save_pretrained`` names them)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    return split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=max_shard_size)


@dataclass(frozen=True)
class SaveConversion:
    """How transformers turns one model tensor into checkpoint tensors when saving."""

    operations: tuple[Any, ...]  # transformers ConversionOps, applied in order
    target_patterns: tuple[str, ...]  # checkpoint names, '*' standing for a list index
    layer_name: str  # the model key with its matched part replaced by the first target pattern


class SaveConversions:
    """transformers' save conversions for one model (as ``revert_weight_conversion`` builds
    them), made once: which converter a key meets, and the renamings after it."""

    def __init__(self, model: nn.Module) -> None:
        reverse = [c.reverse_transform() for c in _conversions(model)[::-1]]
        try:
            from transformers.core_model_loading import WeightConverter, WeightRenaming
        except ImportError:  # transformers 4: checkpoints and models share one layout
            self.converters, self.renamings = [], []
            return
        self.converters = [c for c in reverse if isinstance(c, WeightConverter)]
        self.renamings = [c for c in reverse if isinstance(c, WeightRenaming)]

    def for_key(self, key: str) -> SaveConversion | None:
        """The converter transformers applies to ``key`` on save, or None (a rename at most)."""
        if not self.converters:
            return None
        from transformers.core_model_loading import apply_converters

        renamed, pattern = apply_converters(key, self.converters)
        if pattern is None:
            return None
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        return SaveConversion(tuple(converter.operations), tuple(converter.target_patterns), renamed)

    def name(self, name: str) -> str:
        """A name after transformers' save renamings (e.g. Mixtral's ``mlp`` back to ``block_sparse_moe``)."""
        if not self.renamings:
            return name
        from transformers.core_model_loading import apply_renamings

        return apply_renamings(name, self.renamings)


def _conversions(model: nn.Module) -> list[Any]:
    # As revert_weight_conversion builds them for a model made from scratch.
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers 4: checkpoints and models share one layout
        return []
    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


def build_conversion_table() -> None:
    """Build transformers' table of checkpoint conversions now (every model type's, each with
    its regexes compiled: 0.3 s of CPU), which it otherwise builds on a process's first save or
    load. For a process that rank processes fork from: each inherits the table."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4: no conversions
        return
    get_checkpoint_conversion_mapping("llama")
