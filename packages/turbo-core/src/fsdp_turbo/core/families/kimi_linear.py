"""Kimi Linear: Kimi Delta Attention (KDA: a gated delta rule whose decay has one value per key
channel) in most layers, MLA without rotary embeddings between them; a dense first layer, then
MoE with a shared expert (DeepSeek-V3's routing).

KDA's form: separate q, k, v projections, one depthwise convolution over ``[q | k | v]``, the decay
``-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`` per key channel (its parameters on the layer's
``forget_gate``), ``beta = sigmoid(b_proj(x))`` per head, and a sigmoid-gated norm of the output
(gate ``g_b(g_a(x))``) before ``o_proj``. Its key heads are its value heads. The MLA layers' rotary
part of the key is computed but not rotated: every head still reads it."""

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.families.deepseek_v3 import mla_latents
from fsdp_turbo.core.families.facts import Family
from fsdp_turbo.core.families.linear_forms import ByClassName, LinearShape, Projections
from fsdp_turbo.core.families.registry import register_family


class KimiDeltaAttentionForm(ByClassName):
    form = "Kimi Delta Attention"
    rule = "kda"
    class_names = ("KimiLinearDeltaAttention",)

    @classmethod
    def shape(cls, module: nn.Module) -> LinearShape:
        return LinearShape(module.num_heads, module.num_heads, module.head_dim, module.head_dim)

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections:
        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, module.head_dim))

        gate = module.forget_gate
        return Projections(heads(module.q_proj(hidden_states)), heads(module.k_proj(hidden_states)),
                           heads(module.v_proj(hidden_states)), heads(module.g_b_proj(module.g_a_proj(hidden_states))),
                           module.b_proj(hidden_states), heads(gate.f_b_proj(gate.f_a_proj(hidden_states))))

    @classmethod
    def conv(cls, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        return module.conv1d.weight.squeeze(1), module.conv1d.bias, module.activation

    @classmethod
    def decay(cls, module: nn.Module, a: torch.Tensor, heads: slice) -> torch.Tensor:
        gate = module.forget_gate
        bias = gate.dt_bias.view(module.num_heads, module.head_dim)[heads]
        rate = gate.A_log.float().exp().view(module.num_heads)[heads, None]
        return -rate * F.softplus(a.float() + bias.float())

    @classmethod
    def output(cls, module: nn.Module, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return module.o_proj(module.o_norm(out, z).flatten(2))


FAMILY = register_family(Family(
    name="kimi-linear",
    model_types=("kimi_linear",),
    latent_modules=mla_latents("KimiLinearAttention"),
    linear_attention=(KimiDeltaAttentionForm,),
))
