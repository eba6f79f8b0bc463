"""Which MX-trained weights FSDP gathers as MX bytes (``quantization_plan.low_precision_all_gather``).

A pure planner: names in, names out, each check a small function. A weight is gathered as
MX bytes when its module trains in MX (an ``MXLinear``, or fused experts converted to MX) and
every FSDP shard of it is whole blocks along each GEMM's axis, so each rank's quantization of
its shard is the whole weight's:

- a Linear ``[out, in]``: the forward GEMM blocks along ``in`` (dim 1), the input-gradient
  GEMM along ``out`` (dim 0), which FSDP shards: each shard of what tensor parallel leaves the
  rank must be whole blocks of rows;
- fused experts ``[E, N, K]`` (``[E, K, N]`` transposed, as gpt-oss stores them): the forward
  blocks along K, the input gradient along N, and FSDP shards whole experts (dim 0) when a rank
  holds at least as many as shard ranks (else it splits each expert's rows: not gathered as MX
  bytes yet).

Every other converted module is gathered in high precision, with why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from fsdp_turbo.core.model_inspect import fused_weights_transposed
from fsdp_turbo.core.parallel_state import expert_shard_dim
from fsdp_turbo.core.plugin import SplitsParameters
from fsdp_turbo.quantization.converter.plan import Conversion
from fsdp_turbo.quantization.training.mx_gather import GatherSpec, wrap_for_gather
from fsdp_turbo.quantization.training.recipe import MXRecipe

LINEAR, EXPERTS = "mx_linear", "mx_experts"  # the converters whose weights gather as MX bytes
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class GatheredWeight:
    """One weight FSDP gathers as MX bytes: its parameter name and its GEMMs' block axes."""

    parameter: str
    forward_axis: int
    backward_axis: int


@dataclass(frozen=True)
class Sharding:
    """How FSDP shards a dense weight (``dense`` ranks, dim 0) and an expert-parallel rank's
    experts (``expert`` ranks; ``ep``: the expert-parallel size splitting the experts first)."""

    dense: int
    expert: int
    ep: int


def _shard_not_whole_blocks(length: int, shards: int, block: int, what: str) -> str | None:
    shard = math.ceil(length / shards)
    if shard % block:
        return f"its FSDP shard of {length} {what} over {shards} ranks is {shard}, not whole blocks of {block}"
    return None


def _linear(model: nn.Module, name: str, block: int, sharding: Sharding, tp: SplitsParameters | None,
            ) -> tuple[list[GatheredWeight], str | None]:
    module = model.get_submodule(name)
    whole = (module.out_features, module.in_features)
    # FSDP shards what tensor parallel leaves each rank
    rows = tp.local_shape(f"{name}.weight", whole)[0] if tp is not None else whole[0]
    why = _shard_not_whole_blocks(rows, sharding.dense, block, "output rows")
    return ([] if why else [GatheredWeight(f"{name}.weight", 1, 0)]), why


def _experts(model: nn.Module, name: str, sharding: Sharding) -> tuple[list[GatheredWeight], str | None]:
    module = model.get_submodule(name)
    experts = module.gate_up_proj.shape[0]
    shards, local = (sharding.expert, experts // sharding.ep) if sharding.ep > 1 else (sharding.dense, experts)
    if expert_shard_dim(local, shards) != 0:
        return [], (f"expert FSDP splits each expert ({local} experts a rank, {shards} shard ranks), and only whole "
                    "experts per rank gather as MX bytes yet")
    # [E, N, K]: forward along K (2), input gradient along N (1); transposed [E, K, N] the other way
    forward, backward = (1, 2) if fused_weights_transposed(module) else (2, 1)
    return [GatheredWeight(f"{name}.{weight}", forward, backward) for weight in EXPERT_WEIGHTS], None


def plan_gathers(model: nn.Module, conversions: Sequence[Conversion], recipe: MXRecipe, sharding: Sharding,
                 tp: SplitsParameters | None) -> tuple[tuple[GatheredWeight, ...], tuple[tuple[str, str], ...]]:
    """(weights FSDP gathers as MX bytes, (module, why) for converted modules gathered in high precision)."""
    gathered, high = [], []
    for conversion in conversions:
        if conversion.converter == LINEAR:
            weights, why = _linear(model, conversion.name, recipe.block_size, sharding, tp)
        elif conversion.converter == EXPERTS:
            weights, why = _experts(model, conversion.name, sharding)
        else:
            weights, why = [], (f"{conversion.converter} does not train it in MX (frozen MX weights gather as "
                                "their stored bytes already)")
        gathered += weights
        if why is not None:
            high.append((conversion.name, why))
    return tuple(gathered), tuple(high)


def apply_gathers(model: nn.Module, weights: Sequence[GatheredWeight], recipe: MXRecipe, *, both: bool) -> None:
    """Make each planned weight gather as MX bytes (before tensor parallel, expert parallel and FSDP)."""
    for weight in weights:
        module, _, name = weight.parameter.rpartition(".")
        spec = GatherSpec(recipe, forward_axis=weight.forward_axis, backward_axis=weight.backward_axis, both=both)
        wrap_for_gather(model.get_submodule(module), name, spec)
