"""``MXFrozenExperts``: fused MoE experts whose frozen weights are stored as MX bytes (QLoRA-MX).

The experts of transformers v5 (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, forward
``(hidden_states, top_k_index, top_k_weights)``) hold the bulk of a MoE model's weights; a LoRA
run on the attention leaves them frozen. Each of the two weights is quantized once, blocks of
``block_size`` along its last dim (the GEMM's input features, as ``MXFrozenLinear``'s), and kept
as one uint8 parameter of the same name: ``[E, N, K // block * (block + 1)]``, each block's element
codes followed by its E8M0 scale (``pack_mx`` over the flattened leading dims). That is
``1 + 1/block_size`` bytes per element. Any cut of the leading dims (EP keeps whole experts, expert
FSDP shards dim 0 or 1, dense FSDP dim 0) leaves whole blocks with their scales, so every shard is
the packing of the same shard of the weight; checkpoints see the values through the stored form
:class:`MXPackedLastDim`. A meta weight becomes a meta packed parameter, quantized when loaded.

FSDP2 all-gathers the bytes as they are (it leaves mixed precision off for a non-floating
parameter), and expert parallel keeps them as they are (it slices whole experts).

Compute: no GEMM reads MX. Each expert GEMM dequantizes its weight (after the all-gather) to the
input's dtype and runs the same grouped GEMM high-precision experts run (turbo-core's
``grouped_linear``); the gate is the module's own (``_apply_gate``, else ``act_fn(gate) * up``).
The module's forward sorts the routed slots by expert (as transformers' grouped forward does) and
sums each token's slots; expert parallel calls the op ``mx.frozen_experts_grouped`` on its
expert-major rows for every dispatcher (the module names the op in ``mx_experts_op``). Fused experts
with biases or transposed weights are left in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.grouped_mm import grouped_linear
from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.core.model_inspect import expert_gate, fused_experts_form, is_dtensor, local_tensor
from fsdp_turbo.core.ops import call_op, register_op
from fsdp_turbo.quantization.frozen.mx_frozen_linear import MXPackedRows, packed_width
from fsdp_turbo.quantization.training.recipe import MXRecipe

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
FROZEN_EXPERTS_OP = "mx.frozen_experts_grouped"


@dataclass(frozen=True)
class MXPackedLastDim:
    """The stored form (turbo-core's ``StoredForm``) of a packed frozen weight of any rank: blocks
    along the last dim, packed as ``MXPackedRows`` packs rows; the leading dims are the values' own."""

    recipe: MXRecipe
    values_dtype: torch.dtype

    @property
    def _rows(self) -> MXPackedRows:
        return MXPackedRows(self.recipe, self.values_dtype)

    def values_box(self, start: tuple[int, ...], size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        block = self.recipe.block_size
        per = block + 1
        if start[-1] % per or size[-1] % per:
            raise ValueError(f"a box of packed MX weights must hold whole blocks of {per} bytes along the last dim, "
                             f"not {start[-1]}:{start[-1] + size[-1]}")
        return (*start[:-1], start[-1] // per * block), (*size[:-1], size[-1] // per * block)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        width = packed_width(values.shape[-1], self.recipe.block_size)
        if values.numel() == 0:  # an empty shard (more ranks than rows) has no block to quantize
            return torch.empty(*values.shape[:-1], width, dtype=torch.uint8, device=values.device)
        return self._rows.encode(values.reshape(-1, values.shape[-1])).reshape(*values.shape[:-1], width)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        elements = stored.shape[-1] // (self.recipe.block_size + 1) * self.recipe.block_size
        if stored.numel() == 0:
            return torch.empty(*stored.shape[:-1], elements, dtype=dtype, device=stored.device)
        return self._rows.decode(stored.reshape(-1, stored.shape[-1]), dtype).reshape(*stored.shape[:-1], elements)


class _FrozenGroupedLinear(torch.autograd.Function):
    """``grouped_linear`` over a dequantized packed ``[E, N, K]`` weight. Saves the packed bytes, not
    the values, and dequantizes again for the input gradient.

    Why: a GEMM's own autograd saves its weight for the input gradient. For high-precision experts
    that is the all-gathered parameter, whose storage FSDP frees after the forward and gathers again
    before the backward. A dequantized weight is a new tensor nobody frees: saved, it would hold every
    layer's (unsharded) experts in high precision from the forward to the backward, more than the
    model without QLoRA holds, and once per token chunk under the mc2 / domino dispatchers. Saving
    the bytes keeps only what the high-precision experts keep (FSDP's storage), for one more
    dequantization per GEMM in the backward. The weight is frozen: there is no weight gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor, form: MXPackedLastDim
                ) -> torch.Tensor:
        ctx.save_for_backward(packed, offsets)
        ctx.form = form
        return grouped_linear(x, form.decode(packed, x.dtype), offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        packed, offsets = ctx.saved_tensors
        weight = ctx.form.decode(packed, grad_out.dtype)  # [E, N, K]: grad_x = grad_out @ W per group
        return grouped_linear(grad_out.contiguous(), weight.transpose(1, 2), offsets), None, None, None


@register_op(FROZEN_EXPERTS_OP)
def frozen_experts_grouped(module: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Frozen MX experts on expert-major rows: ``x [M, H]`` with ``group_sizes[e]`` rows for local
    expert ``e`` -> ``[M, H]``. Expert parallel calls this op by name (``mx_experts_op``) for every
    dispatcher; the module's own forward calls it too."""
    offsets = torch.cumsum(group_sizes, 0)
    forms = module.stored_forms
    gate_up = _FrozenGroupedLinear.apply(x, local_tensor(module.gate_up_proj), offsets, forms["gate_up_proj"])
    return _FrozenGroupedLinear.apply(expert_gate(module, gate_up), local_tensor(module.down_proj), offsets,
                                      forms["down_proj"])


class MXFrozenExperts(nn.Module):
    """Mixed into the experts' own class by :func:`to_mx_frozen_experts`: ``gate_up_proj`` and
    ``down_proj`` are packed MX bytes (see the module docstring)."""

    mx_recipe: MXRecipe
    mx_experts_op: ClassVar[str] = FROZEN_EXPERTS_OP  # what expert parallel calls for these experts

    # Eager under torch.compile (one graph break per MoE layer): the group sizes are data.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        num_experts, (tokens, top_k) = self.gate_up_proj.shape[0], top_k_index.shape
        slots = top_k_index.reshape(-1)
        # transformers' order (torch.sort), so the grouped GEMMs see the rows it gives them
        _, order = torch.sort(slots)
        counts = torch.bincount(slots, minlength=num_experts)[:num_experts]
        kept = order[: int(counts.sum())]  # slots routed to no local expert (ids >= num_experts) sort last
        rows = call_op(FROZEN_EXPERTS_OP, hidden_states.device.type, self, hidden_states[kept // top_k], counts)
        weighted = rows * top_k_weights.reshape(-1)[kept].unsqueeze(-1)
        # each token's slots summed in slot order, not scattered by index_add_ (deterministic on every device)
        per_slot = weighted.new_zeros(slots.numel(), weighted.shape[-1]).index_copy(0, kept, weighted)
        return per_slot.view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        r = self.mx_recipe
        return f"frozen weights stored {r.quant_format}/{r.block_size}/{r.scale_mode}"


def frozen_experts_unsupported(module: nn.Module, recipe: MXRecipe) -> str | None:
    """Why ``module`` (fused experts) cannot store its weights MX, else None."""
    form = fused_experts_form(module)
    if form.transposed or form.has_bias:
        return "frozen MX experts take [E, 2I, H] / [E, H, I] weights without biases"
    bad = [f"{n}={v}" for n, v in (("hidden", form.hidden), ("intermediate", form.intermediate))
           if v % recipe.block_size]  # the last dims: gate_up_proj's hidden, down_proj's intermediate
    return f"{', '.join(bad)} not divisible by block_size={recipe.block_size}" if bad else None


def _packed_parameter(weight: torch.Tensor, form: MXPackedLastDim) -> nn.Parameter:
    if weight.is_meta:
        packed = torch.empty(*weight.shape[:-1], packed_width(weight.shape[-1], form.recipe.block_size),
                             dtype=torch.uint8, device="meta")
    else:
        packed = form.encode(weight.detach())
    return nn.Parameter(packed, requires_grad=False)


def to_mx_frozen_experts(module: nn.Module, recipe: MXRecipe) -> nn.Module:
    """Quantize ``module``'s frozen fused expert weights into packed MX parameters of the same names,
    in place. Meta weights (a model built on the meta device) become meta packed parameters,
    quantized when loaded (``load_pretrained`` / ``init_weights`` encode through the stored forms)."""
    weights = {name: getattr(module, name) for name in EXPERT_WEIGHTS}
    sharded = {name: w.placements for name, w in weights.items() if is_dtensor(w)}
    if sharded:  # after expert parallel, this forward would also be mixed in over the dispatcher's
        raise ConfigError("quantization_plan.store_frozen_weights", True, "convert the experts before expert "
                          "parallel and FSDP (convert_model first; the facade quantizes first)",
                          reason=f"their weights are already DTensors ({sharded})")
    forms = {name: MXPackedLastDim(recipe, weight.dtype) for name, weight in weights.items()}
    for name, weight in weights.items():
        setattr(module, name, _packed_parameter(weight, forms[name]))
    return mix_in(module, MXFrozenExperts, "MXFrozen", mx_recipe=recipe, stored_forms=forms)
