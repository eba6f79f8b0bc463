"""Llama 4 (text): chunked attention (``layer_types`` ``chunked_attention``: a query sees the
keys of its own block of ``attention_chunk_size`` positions) in the RoPE layers, full causal
attention in the NoPE ones, whose queries are scaled by a function of their index in the row
(temperature tuning); MoE layers with a sigmoid top-k router and a shared expert.

Its experts take every token, pre-scaled by its routing score, as one dense ``[E * T, H]``
call: nothing a dispatcher can route. Two member patches give them the fused form's call
instead, computing the same sum: the MoE block hands the experts each (token, slot) row scaled
by its score, with the expert it goes to and a unit weight, and the experts run those rows
through the routed experts only."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_turbo.core.families.facts import Family, MemberPatch, SizeNames
from fsdp_turbo.core.families.registry import register_family


def routed_moe_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe.forward`` through a routed call: the block's output is the shared expert's
    plus, for each of a token's ``top_k`` experts, that expert on the token times its score (the
    model scales the expert's input, not its output; an expert of score 0 adds 0)."""
    rows = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(rows)  # called as the model calls it (output recorders see the logits)
    index = logits.topk(self.top_k, dim=-1).indices  # the router's own choice
    weights = scores.gather(1, index)
    scaled = (rows[:, None, :] * weights[..., None]).reshape(-1, self.hidden_dim)
    ones = torch.ones(scaled.shape[0], 1, dtype=scaled.dtype, device=scaled.device)
    routed = self.experts(scaled, index.reshape(-1, 1), ones).view(rows.shape[0], self.top_k, -1).sum(1)
    return self.shared_expert(rows) + routed, logits


def routed_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """``Llama4TextExperts`` called as fused experts are: each row through its ``k`` experts
    (``gate_up_proj [E, H, 2I]``: gate then up; ``down_proj [E, I, H]``), weighted and summed."""
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == expert)
        gate, up = (hidden_states[token] @ self.gate_up_proj[expert]).chunk(2, dim=-1)
        value = (up * self.act_fn(gate)) @ self.down_proj[expert]
        out = out.index_add(0, token, value * top_k_weights[token, slot, None].to(value.dtype))
    return out


def temperature(module: nn.Module, index: torch.Tensor) -> torch.Tensor | None:
    """The scale a NoPE layer's queries get at row index ``index`` (None: the layer scales none)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return None
    return torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


FAMILY = register_family(Family(
    name="llama-4",
    model_types=("llama4_text",),
    sizes=SizeNames(moe_intermediate=("intermediate_size",), intermediate=("intermediate_size_mlp",)),
    patches=(MemberPatch("Llama4TextMoe", "forward", routed_moe_forward,
                         "the experts are called as routed rows, not as a dense [E * T, H] call"),
             MemberPatch("Llama4TextExperts", "forward", routed_experts_forward,
                         "the fused experts' routed call"),),
    query_scales=temperature,
))
