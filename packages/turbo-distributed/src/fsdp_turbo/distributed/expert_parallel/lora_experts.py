"""LoRA on fused expert weights (PEFT's ``target_parameters``), recognised by shape: this
package never imports peft.

PEFT puts one tuner layer ("ParamWrapper") per adapted parameter around the experts, nested
(``experts`` -> ``experts.base_layer`` -> ``experts.base_layer.base_layer``, the real fused
experts). A wrapper holds ``base_layer``, ``parameter_name``, ``lora_A`` / ``lora_B``
(ModuleDicts of ``nn.Linear`` by adapter name), ``scaling`` and the active adapters. Each
adapter is one rank-``r`` LoRA per expert, stacked:

- ``lora_A.weight [E * r, in]``: expert ``e``'s rows are ``[e * r, (e + 1) * r)``;
- ``lora_B.weight [out, r * E]``: viewed ``[out, r, E]``, expert ``e``'s columns are
  ``j * E + e`` (interleaved, expert-minor);

and the effective weight is ``W[e] + scaling * B_e @ A_e`` (``A_e^T @ B_e^T`` for
``is_transposed`` experts), which PEFT folds in at forward by a parametrization of the base
parameter (``baddbmm``).

Under expert parallel the outermost wrapper is the container (patterns name it
``*mlp.experts``; the model facts find it as the outermost recognised module), so expert
FSDP shards the adapters in the same unit as their experts and reduces their gradients over
the expert mesh. Its forward becomes the dispatcher's, which runs the fused experts' math
on the effective weights of the local experts. PEFT's own forward is not used: its
parametrization re-registers the base parameter on every call, which FSDP2 (that swaps the
same parameter between its sharded and unsharded forms) cannot share. The wrappers stay in
place, so ``state_dict`` keys are PEFT's, and the adapters are DTensors of global shape on
the EP mesh: ``lora_A`` ``Shard(0)``, ``lora_B`` ``_StridedShard(1, split_factor=r)`` (each
rank's columns are ``r`` strided blocks, whose local layout is PEFT's for ``E / ep`` experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_inspect import local_tensor
from fsdp_turbo.distributed.expert_parallel.experts import FusedExperts, is_quantized
from fsdp_turbo.distributed.expert_parallel.forms import keep_expert_rows, register_expert_form

BASE_LAYER = "base_layer"
_FUSED_WEIGHTS = ("gate_up_proj", "down_proj")


def is_param_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` has the shape of PEFT's LoRA ``ParamWrapper``: one parameter of its
    ``base_layer`` adapted by per-adapter ``lora_A`` / ``lora_B`` layers."""
    return (isinstance(getattr(module, BASE_LAYER, None), nn.Module)
            and isinstance(getattr(module, "parameter_name", None), str)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
            and isinstance(getattr(module, "scaling", None), dict))


def _peel(module: nn.Module) -> tuple[tuple[tuple[str, str], ...], str, nn.Module]:
    """``((wrapper path, adapted parameter), ...)``, the innermost module's path and itself."""
    wrappers, path = [], ""
    while is_param_wrapper(module):
        wrappers.append((path, module.parameter_name))
        module = getattr(module, BASE_LAYER)
        path = f"{path}.{BASE_LAYER}" if path else BASE_LAYER
    return tuple(wrappers), path, module


def _submodule(module: nn.Module, path: str) -> nn.Module:
    return module.get_submodule(path) if path else module


def keep_strided_expert_columns(layer: nn.Module, name: str, first: int, count: int, num_experts: int,
                                ep_mesh) -> None:
    """Keep experts ``[first, first + count)`` of ``layer.<name> [out, r * E]`` whose columns
    are ``[r, E]`` (expert-minor): ``r`` strided blocks of ``count`` columns, in the local
    layout ``[out, r * count]`` of ``count`` experts. On ``ep_mesh`` a DTensor
    ``_StridedShard(1, split_factor=r)`` of the global shape."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    full = getattr(layer, name)
    out, columns = full.shape
    rank = columns // num_experts
    block = full.detach().reshape(out, rank, num_experts)[:, :, first : first + count].reshape(out, rank * count)
    block = block.clone()
    if ep_mesh is not None:
        block = DTensor.from_local(block, ep_mesh, [_StridedShard(1, split_factor=rank)], run_check=False)
    setattr(layer, name, nn.Parameter(block, requires_grad=full.requires_grad))


@register_expert_form
@dataclass(frozen=True)
class LoraExperts(FusedExperts):
    """Fused experts inside PEFT LoRA wrappers of their ``gate_up_proj`` / ``down_proj``."""

    wrappers: tuple[tuple[str, str], ...] = ()  # (wrapper path inside the container, parameter it adapts)
    base: str = ""  # the fused experts' path inside the container
    form: ClassVar[str] = ("fused experts inside PEFT LoRA wrappers of gate_up_proj/down_proj "
                           "(LoraConfig.target_parameters)")

    @classmethod
    def detect(cls, module: nn.Module) -> LoraExperts | None:
        wrappers, base, inner = _peel(module)
        fused = FusedExperts.detect(inner) if wrappers else None
        if fused is None:
            return None
        return cls(fused.num_experts, fused.transposed, wrappers, base)

    def experts_module(self, module: nn.Module) -> nn.Module:
        return _submodule(module, self.base)

    def _wrapper_layers(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(_submodule(module, path), parameter) for path, parameter in self.wrappers]

    # ----- what cannot be honoured, before anything is changed or sent --------------------
    def check(self, name: str, module: nn.Module) -> None:
        if is_quantized(self.experts_module(module)):
            raise ConfigError("quantization_plan", name, "leave LoRA-adapted experts out of MX training",
                              reason="MX experts run as one grouped kernel with no room for the adapters")
        for wrapper, parameter in self._wrapper_layers(module):
            where = f"{name}.{parameter}"
            if parameter not in _FUSED_WEIGHTS:
                raise ConfigError("LoraConfig.target_parameters", where, "target the fused expert weights "
                                  "only, e.g. ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']",
                                  reason="expert parallel folds adapters into gate_up_proj/down_proj only")
            if getattr(wrapper, "merged", False):
                raise ConfigError("merge_adapter", where, "unmerge the adapters (or merge_and_unload) before "
                                  "FSDPTurbo", reason="merged adapters are folded into the experts' weights")
            for adapter in wrapper.lora_A:
                self._check_adapter(wrapper, adapter, where)

    def _check_adapter(self, wrapper: nn.Module, adapter: str, where: str) -> None:
        dropouts = getattr(wrapper, "lora_dropout", None)
        dropout = dropouts[adapter] if isinstance(dropouts, nn.ModuleDict) and adapter in dropouts else None
        if dropout is not None and not isinstance(dropout, nn.Identity):
            raise ConfigError("LoraConfig.lora_dropout", f"{where} ({adapter})", "set lora_dropout=0 for LoRA on "
                              "experts", reason="a dropout of the tokens cannot be folded into the expert weights")
        lora_a, lora_b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
        if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)) or lora_b.bias is not None:
            raise ConfigError("LoraConfig.lora_bias", f"{where} ({adapter})", "use plain LoRA (lora_bias=False, "
                              "no variant) on experts", reason="expert parallel folds only B @ A into the weights")
        if lora_a.weight.shape[0] % self.num_experts or lora_b.weight.shape[1] != lora_a.weight.shape[0]:
            raise ConfigError("LoraConfig.target_parameters", f"{where} ({adapter})", "target the stacked expert "
                              f"weights, one rank-r adapter per expert ({self.num_experts} experts)",
                              reason=f"lora_A {tuple(lora_a.weight.shape)} / lora_B {tuple(lora_b.weight.shape)} "
                                     "do not stack per expert")

    # ----- sharding -------------------------------------------------------------------------
    def keep_local_experts(self, module: nn.Module, first: int, count: int, ep_mesh) -> None:
        super().keep_local_experts(module, first, count, ep_mesh)
        for wrapper, _ in self._wrapper_layers(module):
            for adapter in wrapper.lora_A:
                lora_a, lora_b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
                rank = lora_a.weight.shape[0] // self.num_experts
                keep_expert_rows(lora_a, ["weight"], first, count, ep_mesh, rows_per_expert=rank)
                keep_strided_expert_columns(lora_b, "weight", first, count, self.num_experts, ep_mesh)

    # ----- the effective weights --------------------------------------------------------------
    # A replica copies the folded weights (``home_weights`` reads them through ``weight``), so
    # its gradient reaches the adapters through the fold.
    def weight(self, module: nn.Module, name: str) -> torch.Tensor:
        weight = super().weight(module, name)
        for wrapper, parameter in self._wrapper_layers(module):
            if parameter == name:
                weight = self._fold(wrapper, weight)
        return weight

    def _fold(self, wrapper: nn.Module, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` plus every active adapter's ``scaling * B_e @ A_e``, as PEFT's
        ``get_delta_factors`` and its ``baddbmm`` fold form it (same order of operations)."""
        if getattr(wrapper, "disable_adapters", False):
            return weight
        local = weight.shape[0]
        for adapter in [a for a in wrapper.active_adapters if a in wrapper.lora_A]:
            lora_a = local_tensor(wrapper.lora_A[adapter].weight)  # [local * r, in]
            lora_b = local_tensor(wrapper.lora_B[adapter].weight)  # [out, r * local]
            lora_a = lora_a.reshape(local, -1, lora_a.shape[-1])  # (experts, r, in)
            lora_b = lora_b.reshape(lora_b.shape[0], -1, local).permute(2, 0, 1)  # (experts, out, r)
            # stored [E, out, in]; transposed experts store [E, in, out]
            lhs, rhs = (lora_a.transpose(-2, -1), lora_b.transpose(-2, -1)) if self.transposed else (lora_b, lora_a)
            # autocast would change the fold's dtype; PEFT folds in the weight's dtype too
            with torch.autocast(device_type=weight.device.type, enabled=False):
                weight = torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype),
                                       alpha=wrapper.scaling[adapter])
        return weight
