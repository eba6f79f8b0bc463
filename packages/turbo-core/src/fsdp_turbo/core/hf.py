"""The few Hugging Face transformers entry points feature packages use, in one place.

transformers is optional (``turbo-core[hf]``) and imported lazily, only when a feature works
on an HF model; feature packages reach it through here and never import it themselves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn


def register_attention_function(name: str, function: Callable[..., Any]) -> None:
    """Make ``function`` selectable as ``config._attn_implementation = name``."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


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
