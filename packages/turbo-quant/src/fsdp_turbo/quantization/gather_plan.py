"""Which MX-trained weights FSDP gathers as MX bytes (``quantization_plan.low_precision_all_gather``).

A pure planner: names in, names out, each check a small function. A weight is gathered as
MX bytes when its module trains as an ``MXLinear`` and every FSDP shard of it (dim 0, the
output features) is a whole number of blocks, so each rank's quantization of its shard is
the whole weight's. Every other converted module is gathered in high precision, with why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from fsdp_turbo.core.plugin import SplitsParameters
from fsdp_turbo.quantization.converter.plan import Conversion
from fsdp_turbo.quantization.training.mx_gather import GatherSpec, wrap_for_gather
from fsdp_turbo.quantization.training.recipe import MXRecipe

GATHERED_CONVERTER = "mx_linear"  # the converter whose weights gather as MX bytes


def _not_a_trained_linear(conversion: Conversion) -> str | None:
    if conversion.converter != GATHERED_CONVERTER:
        return (f"{conversion.converter} weights are not gathered as MX bytes yet (only {GATHERED_CONVERTER}'s "
                "are)")
    return None


def _shard_not_whole_blocks(rows: int, shards: int, block: int) -> str | None:
    shard = math.ceil(rows / shards)
    if shard % block:
        return f"its FSDP shard of {rows} output rows over {shards} ranks is {shard} rows, not whole blocks of {block}"
    return None


def _why_not_gathered(model: nn.Module, conversion: Conversion, block: int, shards: int,
                      tp: SplitsParameters | None) -> str | None:
    if (why := _not_a_trained_linear(conversion)) is not None:
        return why
    module = model.get_submodule(conversion.name)
    whole = (module.out_features, module.in_features)
    # FSDP shards what tensor parallel leaves each rank
    rows = tp.local_shape(f"{conversion.name}.weight", whole)[0] if tp is not None else whole[0]
    return _shard_not_whole_blocks(rows, shards, block)


def plan_gathers(model: nn.Module, conversions: Sequence[Conversion], recipe: MXRecipe, shards: int,
                 tp: SplitsParameters | None) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(modules whose weight gathers as MX bytes, (module, why) for those gathered in high precision).
    ``shards``: the ranks FSDP shards a dense weight over."""
    gathered, high = [], []
    for conversion in conversions:
        why = _why_not_gathered(model, conversion, recipe.block_size, shards, tp)
        if why is None:
            gathered.append(conversion.name)
        else:
            high.append((conversion.name, why))
    return tuple(gathered), tuple(high)


def apply_gathers(model: nn.Module, names: Sequence[str], recipe: MXRecipe, *, both: bool) -> None:
    """Make each named MX Linear's weight gather as MX bytes (before ``fully_shard``). A Linear's
    forward GEMM blocks along ``in_features`` (dim 1), its input-gradient GEMM along ``out_features``."""
    spec = GatherSpec(recipe, forward_axis=1, backward_axis=0, both=both)
    for name in names:
        wrap_for_gather(model.get_submodule(name), "weight", spec)
