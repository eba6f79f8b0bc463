"""``MXFrozenLinear``: a Linear whose frozen weight is stored as MX bytes (QLoRA-MX).

Storage: the weight is quantized once, blocks of ``block_size`` along ``in_features``, and kept
as one uint8 parameter of shape ``(out_features, in_features // block_size * (block_size + 1))``:
each block's element codes (E4M3 / E5M2 / HIF8, one byte each) followed by its E8M0 scale (one
byte). That is ``1 + 1/block_size`` bytes per element, 0.52x of bf16 and 0.26x of fp32 at block 32.

Blocks are interleaved with their scales so that any cut on block edges, along either dim,
leaves whole blocks with their own scales: FSDP2 shards dim 0 (whole rows), tensor parallel
shards dim 0 (colwise) or dim 1 (rowwise, at a multiple of the block), and every shard is the
packing of the same shard of the weight. Checkpoints see the values through ``stored_forms``
(turbo-core's ``checkpoint.stored_forms``): a load quantizes each rank's own box, a save
dequantizes what it gathers. A model built on the meta device gets a meta packed parameter.

The all-gather moves the same bytes: FSDP2 leaves mixed precision off for a non-floating
parameter (``FSDPParam.init_dtype_attrs``), so nothing casts the bytes to ``param_dtype``
before the collective, and no tensor subclass with ``fsdp_pre_all_gather`` is needed to keep
them MX.

GEMMs: none reads MX. After the all-gather the weight is dequantized to the input's dtype for
the forward GEMM, and dequantized again from the saved bytes for the input-gradient GEMM (so the
dequantized weight is not kept between forward and backward). The weight is frozen: there is no
weight-gradient GEMM. A bias, if any, stays a high-precision parameter.

Tensor parallel: the facade quantizes first (``Stage.QUANTIZE`` comes before
``Stage.TENSOR_PARALLEL``), so TP's styles distribute the packed bytes: colwise cuts rows,
rowwise cuts packed columns, which lands on block edges when each rank's ``in_features`` is a
multiple of the block (the quantize transform leaves other Linears high precision). A weight
that is already a TP DTensor when converted is packed shard by shard into a DTensor of the same
placements. Either way each rank holds the packing of its shard of the weight, and the forward
runs the GEMMs on that shard, returning the DTensor ``F.linear`` would (``quantization.tp_linear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn import functional

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.quantization.mx_formats.formats import get_format
from fsdp_turbo.quantization.mx_formats.mx_tensor import MXTensor, dequantize_mx, quantize_mx
from fsdp_turbo.quantization.tp_linear import tp_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe


def quantize_frozen_weight(weight: torch.Tensor, recipe: MXRecipe) -> MXTensor:
    """The one quantization of a frozen ``(out, in)`` weight: blocks along ``in_features``.
    The single-process reference uses it too, so both sides hold the very same codes."""
    return quantize_mx(weight.detach(), recipe.quant_format, recipe.block_size, recipe.scale_mode, axis=-1,
                       emax_elem=recipe.emax_elem)


def frozen_weight_values(weight: torch.Tensor, recipe: MXRecipe, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values ``MXFrozenLinear`` computes with for ``weight`` (quantized, then dequantized)."""
    return dequantize_mx(quantize_frozen_weight(weight, recipe), dtype or weight.dtype)


def packed_width(in_features: int, block_size: int) -> int:
    """Bytes per packed row: each block's codes and its scale."""
    return in_features // block_size * (block_size + 1)


def pack_mx(mx: MXTensor) -> torch.Tensor:
    """``(out, in // block * (block + 1))`` uint8: each block's element codes, then its scale."""
    rows, blocks = mx.scale.shape
    codes = mx.codes.reshape(rows, blocks, mx.block_size)
    return torch.cat([codes, mx.scale.unsqueeze(-1)], dim=-1).reshape(rows, -1).contiguous()


def unpack_mx(packed: torch.Tensor, recipe: MXRecipe, orig_dtype: torch.dtype) -> MXTensor:
    """The ``MXTensor`` a packed weight (or any block-aligned box of one) holds."""
    block = recipe.block_size
    rows = packed.shape[0]
    blocked = packed.reshape(rows, -1, block + 1)
    codes = blocked[..., :block].reshape(rows, -1)  # a copy: codes are contiguous per row for the kernels
    scale = blocked[..., block].contiguous()
    fmt = get_format(recipe.quant_format)
    return MXTensor(data=codes.view(fmt.data_dtype), scale=scale, quant_format=fmt.name,
                    block_size=block, axis=1, scale_mode=recipe.scale_mode,
                    emax_elem=recipe.emax_elem if recipe.emax_elem is not None else fmt.emax_elem,
                    orig_dtype=orig_dtype, orig_shape=codes.shape)


@dataclass(frozen=True)
class MXPackedRows:
    """The stored form (turbo-core's ``StoredForm``) of a packed frozen weight, for checkpoints."""

    recipe: MXRecipe
    values_dtype: torch.dtype

    def values_box(self, start: tuple[int, ...], size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        per = self.recipe.block_size + 1
        if start[1] % per or size[1] % per:
            raise ValueError(f"a box of packed MX rows must hold whole blocks of {per} bytes, not columns "
                             f"{start[1]}:{start[1] + size[1]}")
        block = self.recipe.block_size
        return (start[0], start[1] // per * block), (size[0], size[1] // per * block)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        if values.numel() == 0:  # an empty shard (more FSDP ranks than rows) has no block to quantize
            return torch.empty(values.shape[0], packed_width(values.shape[1], self.recipe.block_size),
                               dtype=torch.uint8, device=values.device)
        return pack_mx(quantize_frozen_weight(values, self.recipe))

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if stored.numel() == 0:
            elements = stored.shape[1] // (self.recipe.block_size + 1) * self.recipe.block_size
            return torch.empty(stored.shape[0], elements, dtype=dtype, device=stored.device)
        return dequantize_mx(unpack_mx(stored, self.recipe, dtype), dtype)


class _FrozenMXLinearFunction(torch.autograd.Function):
    """``functional.linear`` over the dequantized packed weight; saves the packed bytes, not the values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, recipe: MXRecipe
                ) -> torch.Tensor:
        weight = dequantize_mx(unpack_mx(packed, recipe, x.dtype), x.dtype)
        ctx.save_for_backward(packed)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        return functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (packed,) = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = dequantize_mx(unpack_mx(packed, ctx.recipe, grad_out.dtype), grad_out.dtype)
            grad_x = grad_out.matmul(weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, grad_bias, None


class MXFrozenLinear(nn.Linear):
    """A Linear whose frozen weight is a packed MX uint8 parameter (see the module docstring).

    Made in place by :func:`to_mx_frozen_linear`; the parameter keeps its name (``weight``), its
    ``state_dict`` entry holds the packed bytes."""

    mx_recipe: MXRecipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return tp_linear(x, self.weight, self.bias,
                             lambda xl, wl, bl: _FrozenMXLinearFunction.apply(xl, wl, bl, self.mx_recipe))
        return _FrozenMXLinearFunction.apply(x, self.weight, self.bias, self.mx_recipe)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return f"{super().extra_repr()}, frozen weight stored {r.quant_format}/{r.block_size}/{r.scale_mode}"


def _pack(weight: torch.Tensor, form: MXPackedRows) -> torch.Tensor:
    if weight.is_meta:  # quantized when a checkpoint is loaded into it
        return torch.empty(weight.shape[0], packed_width(weight.shape[1], form.recipe.block_size),
                           dtype=torch.uint8, device="meta")
    return form.encode(weight.detach())


def _check_block_edges(weight: DTensor, block: int) -> None:
    """A DTensor weight's shards must cut ``in_features`` on block edges: then the packed bytes,
    split the same way, are each shard's own packing."""
    ways = 1
    for mesh_dim, placement in enumerate(weight.placements):
        if not isinstance(placement, (Shard, Replicate)):
            raise ConfigError("quantization_plan.store_frozen_weights", True, "convert the frozen weight before "
                              "sharding it otherwise than by rows, columns or replication",
                              reason=f"its placement {placement} on {weight.device_mesh} cannot be packed per shard")
        if isinstance(placement, Shard) and placement.dim % weight.dim() == 1:
            ways *= weight.device_mesh.size(mesh_dim)
    in_features = weight.shape[1]
    if in_features % (block * ways):
        raise ConfigError("quantization_plan.block_size", block, "leave this Linear out of quantization_plan "
                          "(ignored_modules), or use a tensor_parallel_size that gives each rank whole blocks",
                          reason=f"in_features={in_features} is split {ways} ways ({weight.placements}), "
                                 f"not into whole blocks of {block}")


def _pack_dtensor(weight: DTensor, form: MXPackedRows) -> DTensor:
    """Each rank packs its own shard; the DTensor keeps the placements, with the packed global shape."""
    _check_block_edges(weight, form.recipe.block_size)
    local = _pack(weight.to_local(), form)
    shape = (weight.shape[0], packed_width(weight.shape[1], form.recipe.block_size))
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False, shape=shape,
                              stride=(shape[1], 1))


def to_mx_frozen_linear(module: nn.Linear, recipe: MXRecipe) -> MXFrozenLinear:
    """Quantize ``module``'s frozen weight into its packed MX parameter, in place. A meta weight
    (a model built on the meta device) becomes a meta packed parameter, quantized when loaded.
    A DTensor weight (tensor parallel applied first) is packed on each rank from its own shard."""
    weight = module.weight
    form = MXPackedRows(recipe, weight.dtype)
    packed = _pack_dtensor(weight, form) if isinstance(weight, DTensor) else _pack(weight, form)
    module.weight = nn.Parameter(packed, requires_grad=False)
    return mix_in(module, MXFrozenLinear, "MXFrozen", mx_recipe=recipe, stored_forms={"weight": form})
