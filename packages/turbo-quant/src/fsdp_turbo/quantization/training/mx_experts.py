"""MX training for fused 3-D MoE experts (transformers v5 form: ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, forward ``(hidden_states, top_k_index, top_k_weights)``).

Tokens are sorted expert-major once and each expert's group is padded with zero rows to the
block size; the two expert GEMMs are MX grouped GEMMs (``mx_grouped_function``), so every
group's weight-gradient GEMM quantizes along its own tokens. Recognised by form, not by
class name. Zero rows stay zero through ``act(gate) * up`` (``up`` is zero there), and their
gradients are zero.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.quantization.training.mx_grouped_function import mx_grouped_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe

_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return False
    _, two_inter, hidden = gate_up.shape
    if down.shape[1:] != (hidden, two_inter // 2) or not hasattr(module, "act_fn"):
        return False
    return tuple(inspect.signature(module.forward).parameters)[:3] == _FORWARD_ARGS


def experts_unsupported(module: nn.Module, recipe: MXRecipe) -> str | None:
    _, two_inter, hidden = module.gate_up_proj.shape
    bad = [f"{n}={v}" for n, v in (("hidden", hidden), ("intermediate", two_inter // 2)) if v % recipe.block_size]
    return f"{', '.join(bad)} not divisible by block_size={recipe.block_size}" if bad else None


class MXFusedExperts(nn.Module):
    """Mixed into the experts' own class by :func:`to_mx_experts`; parameters are untouched."""

    mx_recipe: MXRecipe

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        recipe = self.mx_recipe
        num_experts = self.gate_up_proj.shape[0]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
        routed = int(counts.sum())  # indices >= num_experts (dropped tokens) sort last
        order = order[:routed]
        tokens = order // top_k_index.shape[-1]
        # Expert-major rows, each group padded with zero rows to a whole number of blocks.
        padded = (counts + recipe.block_size - 1) // recipe.block_size * recipe.block_size
        group_start = torch.cumsum(padded, 0) - padded
        rank_in_group = torch.arange(routed, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
        rows = group_start[flat[order]] + rank_in_group
        x = hidden_states.new_zeros(int(padded.sum()), hidden_states.shape[-1])
        x = x.index_copy(0, rows, hidden_states[tokens])
        offsets = torch.cumsum(padded, 0)
        gate, up = mx_grouped_linear(x, self.gate_up_proj, offsets, recipe).chunk(2, dim=-1)
        out = mx_grouped_linear(self.act_fn(gate) * up, self.down_proj, offsets, recipe)
        weighted = out[rows] * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, tokens, weighted.to(final.dtype))


def to_mx_experts(module: nn.Module, recipe: MXRecipe) -> nn.Module:
    return mix_in(module, MXFusedExperts, "MX", mx_recipe=recipe)
