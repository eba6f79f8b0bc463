"""The built-in expert forms of HF-style models, recognised by form rather than class name
(``forms`` holds the registry; ``counted_experts`` torchtitan's form):

- **Fused 3-D weights** (transformers v5: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3,
  gpt-oss): ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (``[E, H, 2I]`` /
  ``[E, I, H]`` when transposed, as gpt-oss stores them), optional per-expert biases
  ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias [E, H]`` (kept and sharded with their
  experts), and ``forward(hidden_states, top_k_index, top_k_weights)`` (gpt-oss names the
  last two ``router_indices``, ``routing_weights``). The gate is the module's own
  ``_apply_gate`` when it has one (HF's experts decorator adds it; gpt-oss's own is its
  clamped SwiGLU over interleaved gate/up columns, with the module's ``alpha`` and
  ``limit``), else ``act(gate) * up``.
- **A ModuleList of per-expert MLPs** (older and custom models): an ``nn.ModuleList``
  subclass, or a module whose only child is one, with that same forward. Each entry maps
  ``[n, H] -> [n, H]``.

Both take ``forward(hidden_states, top_k_index, top_k_weights)``, the dispatchers' own call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.grouped_mm import grouped_linear
from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.model_inspect import expert_gate, fused_experts_form, has_router_forward, local_tensor
from fsdp_turbo.core.ops import call_op
from fsdp_turbo.distributed.expert_parallel.forms import (
    ExpertAdapter,
    keep_expert_rows,
    loop_over_experts,
    register_expert_form,
    replicas_in_forward,
)

_log = get_logger(__name__)

# Experts converted by turbo-quant carry ``mx_recipe``; turbo-quant registers their grouped
# forward as an op (no import between the two packages): MX training's under this name, others
# (frozen MX experts, whose weights are packed bytes) under the name the module gives in ``mx_experts_op``.
QUANTIZED_EXPERTS_OP = "mx.experts_grouped"


def is_quantized(module: nn.Module) -> bool:
    return getattr(module, "mx_recipe", None) is not None


def quantized_experts_op(module: nn.Module) -> str:
    """The op that runs converted (``is_quantized``) experts on expert-major rows."""
    return getattr(module, "mx_experts_op", QUANTIZED_EXPERTS_OP)


@register_expert_form
@dataclass(frozen=True)
class FusedExperts(ExpertAdapter):
    transposed: bool = False
    form: ClassVar[str] = ("fused 3-D gate_up_proj/down_proj weights ([E, 2I, H]/[E, H, I] or transposed, "
                           "optional [E, out] biases) with forward(hidden_states, top_k_index, top_k_weights)")

    @classmethod
    def detect(cls, module: nn.Module) -> FusedExperts | None:
        found = fused_experts_form(module)
        return None if found is None else cls(found.num_experts, found.transposed)

    def experts_module(self, module: nn.Module) -> nn.Module:
        """The module that holds the fused weights, ``_apply_gate`` and ``act_fn``: the container
        itself (a form that wraps it, such as ``LoraExperts``, says where it is)."""
        return module

    def _param_names(self, module: nn.Module) -> list[str]:
        return [n for n in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
                if isinstance(getattr(module, n, None), nn.Parameter)]

    def keep_local_experts(self, module: nn.Module, first: int, count: int, ep_mesh) -> None:
        experts = self.experts_module(module)
        keep_expert_rows(experts, self._param_names(experts), first, count, ep_mesh)

    replicable: ClassVar[bool] = True

    def home_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        experts = self.experts_module(module)
        if is_quantized(experts):  # MX experts read their weights through turbo-quant's op
            return {}
        return {name: self.weight(module, name) for name in self._param_names(experts)}

    def weight(self, module: nn.Module, name: str) -> torch.Tensor:
        """This rank's block of fused weight ``name`` as the GEMMs use it (stored layout)."""
        return local_tensor(getattr(self.experts_module(module), name))

    def _weights(self, module: nn.Module, replicas: dict[str, torch.Tensor] | None = None) -> tuple:
        """``(gate_up, down, gate_up_bias, down_bias)`` in the GEMMs' layout: this rank's experts,
        or the replica slots' (``replicas``: ``home_weights``' names, ``[spare, ...]``)."""
        def read(name: str) -> torch.Tensor | None:
            if not isinstance(getattr(self.experts_module(module), name, None), torch.Tensor):
                return None
            return self.weight(module, name) if replicas is None else replicas[name]

        gate_up, down = read("gate_up_proj"), read("down_proj")
        if self.transposed:  # stored [E, K, N]; the GEMMs want [E, N, K]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up, down, read("gate_up_proj_bias"), read("down_proj_bias")

    def _weight_sets(self, module: nn.Module) -> list[tuple]:
        """This rank's experts' weights, then the replica slots' in a forward that has them: the
        slots are numbered in that order, and each set runs its own GEMMs (so the experts' own
        weights are never copied into one tensor with the replicas')."""
        replicas = replicas_in_forward(module)
        return [self._weights(module), *([self._weights(module, replicas)] if replicas else [])]

    def eager(self, module: nn.Module, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        experts = self.experts_module(module)
        if is_quantized(experts):  # MX experts only come as grouped GEMMs
            order = torch.argsort(expert, stable=True)
            sizes = torch.bincount(expert, minlength=local_tensor(experts.gate_up_proj).shape[0])
            return self.grouped(module, x[order], sizes)[torch.argsort(order)]
        slots = [(weights, e) for weights in self._weight_sets(module) for e in range(weights[0].shape[0])]

        def run(slot: int, rows: torch.Tensor) -> torch.Tensor:
            (gate_up, down, gate_up_bias, down_bias), e = slots[slot]
            h = F.linear(rows, gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
            return F.linear(expert_gate(experts, h), down[e], None if down_bias is None else down_bias[e])

        return loop_over_experts(x, expert, len(slots), run)

    def grouped(self, module: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        experts = self.experts_module(module)
        if is_quantized(experts):
            return call_op(quantized_experts_op(experts), x.device.type, experts, x, group_sizes)
        sets = self._weight_sets(module)
        if len(sets) == 1:
            return self._grouped_gemms(experts, x, group_sizes, sets[0])
        local = sets[0][0].shape[0]
        split = int(group_sizes[:local].sum())  # expert-major: the home experts' rows come first
        return torch.cat([self._grouped_gemms(experts, x[:split], group_sizes[:local], sets[0]),
                          self._grouped_gemms(experts, x[split:], group_sizes[local:], sets[1])])

    @staticmethod
    def _grouped_gemms(experts: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor, weights: tuple) -> torch.Tensor:
        gate_up, down, gate_up_bias, down_bias = weights
        offsets = torch.cumsum(group_sizes, 0)

        def bias_rows(bias: torch.Tensor | None) -> torch.Tensor | float:
            if bias is None:
                return 0.0
            return bias.repeat_interleave(group_sizes, dim=0, output_size=x.shape[0])

        h = grouped_linear(x, gate_up.to(x.dtype), offsets) + bias_rows(gate_up_bias)
        return grouped_linear(expert_gate(experts, h), down.to(x.dtype), offsets) + bias_rows(down_bias)


def _expert_list(module: nn.Module) -> nn.ModuleList | None:
    if isinstance(module, nn.ModuleList):
        return module
    children = list(module.children())
    if len(children) == 1 and isinstance(children[0], nn.ModuleList) and not list(module.parameters(recurse=False)):
        return children[0]
    return None


# Per-expert SwiGLU MLPs under their usual names (HF / Mixtral v4 / Megatron-style).
_SWIGLU_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@register_expert_form
@dataclass(frozen=True)
class ExpertList(ExpertAdapter):
    """A ModuleList of experts. Non-local entries are removed from the list's registry but
    the local ones keep their global index as their name (``experts.5.w1.weight``), so
    ``state_dict`` keys are the model's own; each key then lives on its owner's ranks."""

    form: ClassVar[str] = "a ModuleList of expert MLPs with forward(hidden_states, top_k_index, top_k_weights)"

    @classmethod
    def detect(cls, module: nn.Module) -> ExpertList | None:
        experts = _expert_list(module)
        if experts is None or not len(experts) or not has_router_forward(module):
            return None
        shapes = {tuple((n, tuple(p.shape)) for n, p in e.named_parameters()) for e in experts}
        if len(shapes) != 1 or not next(iter(shapes)):
            return None
        return cls(len(experts))

    replicable: ClassVar[bool] = True

    @staticmethod
    def local_experts(module: nn.Module) -> list[nn.Module]:
        return list(_expert_list(module)._modules.values())

    def home_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        # Every expert has the same parameters (``detect``): stacked, one name per parameter path.
        experts = self.local_experts(module)
        return {name: torch.stack([local_tensor(e.get_parameter(name)) for e in experts])
                for name, _ in experts[0].named_parameters()}

    def keep_local_experts(self, module: nn.Module, first: int, count: int, ep_mesh) -> None:
        registry = _expert_list(module)._modules
        for name in list(registry):
            if not first <= int(name) < first + count:
                del registry[name]

    def eager(self, module: nn.Module, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        experts, replicas = self.local_experts(module), replicas_in_forward(module)
        spare = next(iter(replicas.values())).shape[0] if replicas else 0

        def run(e: int, rows: torch.Tensor) -> torch.Tensor:
            if e < len(experts):
                return experts[e](rows)
            # a replica slot: the first local expert's module, run on the replica's weights
            weights = {name: stacked[e - len(experts)] for name, stacked in replicas.items()}
            return torch.func.functional_call(experts[0], weights, (rows,))

        return loop_over_experts(x, expert, len(experts) + spare, run)

    def _stacked_swiglu(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, Callable] | None:
        """The local experts' (and this forward's replicas') SwiGLU weights, stacked."""
        experts, replicas = self.local_experts(module), replicas_in_forward(module)
        for gate, up, down in _SWIGLU_NAMES:
            layers = [[getattr(e, n, None) for n in (gate, up, down)] for e in experts]
            if all(isinstance(m, nn.Linear) and m.bias is None for row in layers for m in row):
                act = getattr(experts[0], "act_fn", None) or getattr(experts[0], "act", None) or F.silu
                gate_up = torch.stack([torch.cat([g.weight, u.weight]) for g, u, _ in layers])
                down_stack = torch.stack([d.weight for _, _, d in layers])
                if replicas:
                    extra = torch.cat([replicas[f"{gate}.weight"], replicas[f"{up}.weight"]], dim=1)
                    gate_up = torch.cat([gate_up, extra])
                    down_stack = torch.cat([down_stack, replicas[f"{down}.weight"]])
                return gate_up, down_stack, act
        return None

    def grouped(self, module: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        experts = self.local_experts(module)
        stacked = self._stacked_swiglu(module)
        if stacked is None:
            warn_once(_log, f"{type(experts[0]).__name__} experts are not SwiGLU Linear layers; the fused "
                            "dispatcher runs them one by one")
            return super().grouped(module, x, group_sizes)
        # Stacking copies the weights each step: the price of keeping the model's own modules.
        gate_up, down, act = stacked
        offsets = torch.cumsum(group_sizes, 0)
        gate, up = grouped_linear(x, gate_up.to(x.dtype), offsets).chunk(2, dim=-1)
        return grouped_linear(act(gate) * up, down.to(x.dtype), offsets)

