"""Linear-attention forms: how the features read one kind of recurrent token mixer.

A linear-attention layer (Gated DeltaNet, Kimi Delta Attention) computes per-token
projections, a short causal convolution over its ``[q | k | v]`` channels, a decay and a
delta-rule recurrence per head, then a gated norm and an output projection. Only the first
and the last steps, and where the parameters live, differ from one model to another. A form
says those, so that context parallel's Ulysses forward (all-to-all to head shards, the
convolution and the recurrence over the whole sequence, all-to-all back) is written once:

* ``detect(module)``: whether the module is of this form;
* ``shape(module)``: head counts and dims (:class:`LinearShape`);
* ``project(module, x)``: the per-token projections of a chunk (:class:`Projections`);
* ``conv(module)``: the depthwise convolution's weight ``[channels, kernel]``, bias and
  activation name;
* ``decay(module, a, heads)``: the log decay of the given value heads from their ``a``;
* ``output(module, out, z)``: the gated norm and the output projection.

``rule`` names the recurrence: ``"gated_delta_rule"`` (one decay per head) or ``"kda"``
(one decay per key channel). Forms are registered by their family file; the registry is
:data:`LINEAR_ATTENTION_FORMS` (newest first).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.forms import FormRegistry, class_names


class Projections(NamedTuple):
    """One chunk's per-token projections: q, k ``[B, s, key_heads, dk]``; v, z ``[B, s,
    value_heads, dv]``; b ``[B, s, value_heads]`` (before the sigmoid); a the decay's input,
    ``[B, s, value_heads]`` or ``[B, s, value_heads, dk]`` (a per-channel decay)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor


class LinearShape(NamedTuple):
    key_heads: int
    value_heads: int
    head_k_dim: int
    head_v_dim: int


class LinearAttentionForm(Protocol):
    form: str  # a description, named in plans and errors
    rule: str  # "gated_delta_rule" or "kda"

    @classmethod
    def detect(cls, module: nn.Module) -> bool: ...

    @classmethod
    def shape(cls, module: nn.Module) -> LinearShape: ...

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections: ...

    @classmethod
    def conv(cls, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str]: ...

    @classmethod
    def decay(cls, module: nn.Module, a: torch.Tensor, heads: slice) -> torch.Tensor: ...

    @classmethod
    def output(cls, module: nn.Module, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor: ...


LINEAR_ATTENTION_FORMS: FormRegistry[type[LinearAttentionForm]] = FormRegistry("linear-attention")


def recognise_linear_attention(module: nn.Module) -> type[LinearAttentionForm] | None:
    """The first registered form that recognises ``module``, else ``None``."""
    found = LINEAR_ATTENTION_FORMS.recognise(module)
    return None if found is None else found[0]


class ByClassName:
    """``detect`` by class name (``class_names``; a subclass of a named class counts)."""

    class_names: tuple[str, ...] = ()

    @classmethod
    def detect(cls, module: nn.Module) -> bool:
        return bool(class_names(module) & set(cls.class_names))


class GatedDeltaNetForm(ByClassName):
    """What the Gated DeltaNets of transformers share (Qwen3-Next's, Qwen3.5's): head counts
    ``num_k_heads`` / ``num_v_heads`` and dims ``head_k_dim`` / ``head_v_dim``; one depthwise
    ``conv1d`` over ``[q | k | v]`` with ``activation``; the decay ``-exp(A_log) *
    softplus(a + dt_bias)`` per head; ``norm(out, z)`` then ``out_proj``. A family's form
    adds ``project``."""

    form = "Gated DeltaNet"
    rule = "gated_delta_rule"

    @classmethod
    def shape(cls, module: nn.Module) -> LinearShape:
        return LinearShape(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)

    @classmethod
    def conv(cls, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        return module.conv1d.weight.squeeze(1), module.conv1d.bias, module.activation

    @classmethod
    def decay(cls, module: nn.Module, a: torch.Tensor, heads: slice) -> torch.Tensor:
        return -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])

    @classmethod
    def output(cls, module: nn.Module, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = module.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
        return module.out_proj(normed.reshape(*z.shape[:2], -1))
