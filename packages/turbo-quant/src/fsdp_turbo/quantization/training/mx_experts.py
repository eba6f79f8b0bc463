"""MX training for fused 3-D MoE experts (transformers v5 form: ``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, or transposed ``[E, H, 2I]`` / ``[E, I, H]`` as gpt-oss stores them,
optional per-expert biases, forward ``(hidden_states, top_k_index, top_k_weights)``).

Tokens are sorted expert-major once and each expert's group is padded with zero rows to the
block size; the two expert GEMMs are MX grouped GEMMs (``mx_grouped_function``), so every
group's weight-gradient GEMM quantizes along its own tokens. Recognised by form, not by
class name. The gate is the module's own (``core.model_inspect.expert_gate``: gpt-oss's
clamped SwiGLU over interleaved gate/up, else ``act_fn(gate) * up``). Biases are added to
the real rows only and the padding rows are zeroed after the gate, so they stay zero
whatever the gate makes of a bias, and their gradients are zero: no padding row enters a
block's scale along the tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.core.model_inspect import expert_gate, fused_experts_form, fused_weights_transposed, local_tensor
from fsdp_turbo.core.ops import register_op
from fsdp_turbo.quantization.training.mx_grouped_function import mx_grouped_linear
from fsdp_turbo.quantization.training.recipe import MXRecipe


def is_fused_experts(module: nn.Module) -> bool:
    return fused_experts_form(module) is not None


def experts_unsupported(module: nn.Module, recipe: MXRecipe) -> str | None:
    form = fused_experts_form(module)
    bad = [f"{n}={v}" for n, v in (("hidden", form.hidden), ("intermediate", form.intermediate))
           if v % recipe.block_size]
    return f"{', '.join(bad)} not divisible by block_size={recipe.block_size}" if bad else None


def _gemm_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``gate_up_proj`` / ``down_proj`` as the grouped GEMM takes them, ``[E, N, K]``
    (transposed views of gpt-oss's ``[E, K, N]``: the blocks still run along K)."""
    weights = local_tensor(module.gate_up_proj), local_tensor(module.down_proj)
    if fused_weights_transposed(module):
        return weights[0].transpose(1, 2), weights[1].transpose(1, 2)
    return weights


def _bias_rows(module: nn.Module, name: str, expert: torch.Tensor) -> torch.Tensor | None:
    """Per-row bias ``[M, N]`` of each row's expert, or ``None`` for an unbiased module."""
    bias = getattr(module, name, None)
    return None if bias is None else local_tensor(bias)[expert]


@register_op("mx.experts_grouped")
def mx_experts_grouped(module: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """An MX experts module on expert-major rows: ``x [M, H]`` with ``group_sizes[e]`` rows for
    expert ``e`` -> ``[M, H]``. Each group is padded with zero rows to whole blocks, so every
    wgrad block along the tokens holds one expert's rows. Expert parallel calls this op (by
    name, through the op registry) for experts that were converted to MX."""
    recipe: MXRecipe = module.mx_recipe
    block = recipe.block_size
    padded = (group_sizes + block - 1) // block * block
    expert = torch.repeat_interleave(torch.arange(group_sizes.numel(), device=x.device), group_sizes,
                                     output_size=x.shape[0])
    rank_in_group = torch.arange(x.shape[0], device=x.device) - (torch.cumsum(group_sizes, 0) - group_sizes)[expert]
    rows = (torch.cumsum(padded, 0) - padded)[expert] + rank_in_group
    padded_x = x.new_zeros(int(padded.sum()), x.shape[-1]).index_copy(0, rows, x)
    offsets = torch.cumsum(padded, 0)
    gate_up_weight, down_weight = _gemm_weights(module)
    gate_up = mx_grouped_linear(padded_x, gate_up_weight, offsets, recipe)
    if (bias := _bias_rows(module, "gate_up_proj_bias", expert)) is not None:
        gate_up = gate_up.index_add(0, rows, bias.to(gate_up.dtype))
    real = torch.zeros(gate_up.shape[0], 1, dtype=gate_up.dtype, device=x.device).index_fill_(0, rows, 1.0)
    out = mx_grouped_linear(expert_gate(module, gate_up) * real, down_weight, offsets, recipe)[rows]
    if (bias := _bias_rows(module, "down_proj_bias", expert)) is not None:
        out = out + bias.to(out.dtype)
    return out


class MXFusedExperts(nn.Module):
    """Mixed into the experts' own class by :func:`to_mx_experts`; parameters are untouched."""

    mx_recipe: MXRecipe

    # Eager under torch.compile (one graph break per MoE layer): each expert's padded group
    # size is data, so a traced version would recompile for every routing.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        num_experts = self.gate_up_proj.shape[0]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
        order = order[: int(counts.sum())]  # indices >= num_experts (dropped tokens) sort last
        tokens = order // top_k_index.shape[-1]
        out = mx_experts_grouped(self, hidden_states[tokens], counts)
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, tokens, weighted.to(final.dtype))


def to_mx_experts(module: nn.Module, recipe: MXRecipe) -> nn.Module:
    return mix_in(module, MXFusedExperts, "MX", mx_recipe=recipe)
