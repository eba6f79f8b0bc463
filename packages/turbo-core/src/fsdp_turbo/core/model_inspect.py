"""Structural helpers several packages share: model config values, tied parameters,
DTensor shards and the fused-experts recogniser. What the model *is* (its blocks, head,
attention, inputs, experts) is resolved once, in ``core.model_facts``, not here."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def model_config_value(model: nn.Module, *names: str) -> Any:
    """The first of ``names`` present on ``model.config`` (HF) or the model; else ``None``."""
    for holder in (getattr(model, "config", None), model):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return value
    return None


def tied_parameter_groups(model: nn.Module) -> list[tuple[tuple[str, str], ...]]:
    """The (module name, parameter name) places that share one parameter, for each parameter
    held in more than one place (tied embeddings), in model order."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module.named_parameters(recurse=False):
            places = owners.setdefault(id(param), [])
            if (module_name, param_name) not in places:
                places.append((module_name, param_name))
    return [tuple(places) for places in owners.values() if len(places) > 1]


# ----- DTensors ------------------------------------------------------------------------------
def is_dtensor(value: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # builds without torch.distributed
        return False
    return isinstance(value, DTensor)


def local_tensor(value: torch.Tensor | None, *, differentiable: bool = True) -> torch.Tensor | None:
    """A DTensor's local shard, else the tensor (or None) itself.

    ``differentiable=True`` goes through ``to_local()``, so gradients flow back to the
    DTensor (a GEMM on this rank's block of a weight). ``False`` reads the local tensor
    directly, with no autograd record: for code that moves storage (the swaps)."""
    if not is_dtensor(value):
        return value
    return value.to_local() if differentiable else value._local_tensor


# ----- fused MoE experts ---------------------------------------------------------------------
EXPERT_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
# The same call under other models' names (gpt-oss: ``router_indices``, ``routing_weights``),
# each mapped to the name it stands for in ``EXPERT_FORWARD_ARGS``.
EXPERT_FORWARD_ALIASES = {"router_indices": "top_k_index", "routing_weights": "top_k_weights"}


def has_router_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes ``(hidden_states, top_k_index, top_k_weights)``, under
    those names or their ``EXPERT_FORWARD_ALIASES``."""
    try:
        params = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(EXPERT_FORWARD_ALIASES.get(p, p) for p in params[:3]) == EXPERT_FORWARD_ARGS


@dataclass(frozen=True)
class FusedExpertsForm:
    """The shape of a fused experts container (transformers v5 form).

    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, or transposed ``[E, H, 2I]`` /
    ``[E, I, H]`` (as the module's ``is_transposed`` says, else as the shapes say: the two
    layouts never fit the same pair of shapes: gpt-oss stores its experts transposed, and
    says so only through transformers' experts decorator), optional ``gate_up_proj_bias
    [E, 2I]`` / ``down_proj_bias [E, H]``, and ``forward(hidden_states, top_k_index,
    top_k_weights)`` (or its aliases).
    """

    num_experts: int
    hidden: int
    intermediate: int
    transposed: bool
    has_bias: bool


def _fused_dims(gate_up: torch.Size, down: torch.Size, transposed: bool) -> tuple[int, int, int] | None:
    """``(E, H, I)`` if ``gate_up`` / ``down`` are ``[E, H, 2I]`` / ``[E, I, H]`` (``transposed``)
    or ``[E, 2I, H]`` / ``[E, H, I]``, else ``None``."""
    experts, first, second = gate_up
    hidden, two_inter = (first, second) if transposed else (second, first)
    expected_down = (experts, two_inter // 2, hidden) if transposed else (experts, hidden, two_inter // 2)
    return (experts, hidden, two_inter // 2) if two_inter % 2 == 0 and tuple(down) == expected_down else None


def fused_weights_transposed(module: nn.Module) -> bool | None:
    """Whether fused experts store ``gate_up_proj`` / ``down_proj`` as ``[E, K, N]`` (gpt-oss),
    not ``[E, N, K]``: as the module declares (``is_transposed``), else as the shapes say;
    ``None`` if neither layout fits. A fact of the stored weights, read where they are used."""
    gate_up, down = module.gate_up_proj, module.down_proj
    declared = getattr(module, "is_transposed", None)
    layouts = (bool(declared),) if declared is not None else (False, True)
    return next((t for t in layouts if _fused_dims(gate_up.shape, down.shape, t)), None)


def fused_experts_form(module: nn.Module) -> FusedExpertsForm | None:
    """The form of ``module`` if it is a fused experts container, else ``None``. The one
    recogniser: expert parallel and MX quantization both use it."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0]:
        return None
    transposed = fused_weights_transposed(module)
    if transposed is None:
        return None
    experts, hidden, inter = _fused_dims(gate_up.shape, down.shape, transposed)
    # The gate is the module's own ``_apply_gate`` (HF's experts decorator adds one), else ``act_fn(gate) * up``.
    gated = callable(getattr(module, "_apply_gate", None)) or callable(getattr(module, "act_fn", None))
    if not gated or not has_router_forward(module):
        return None
    biases = {n: getattr(module, n, None) for n in ("gate_up_proj_bias", "down_proj_bias")}
    expected = {"gate_up_proj_bias": (experts, 2 * inter), "down_proj_bias": (experts, hidden)}
    if any(isinstance(b, nn.Parameter) and tuple(b.shape) != expected[n] for n, b in biases.items()):
        return None  # per-expert rows are what expert parallel shards with their experts
    has_bias = any(isinstance(b, nn.Parameter) for b in biases.values())
    return FusedExpertsForm(experts, hidden, inter, transposed, has_bias)


def expert_gate(module: nn.Module, gate_up_out: torch.Tensor) -> torch.Tensor:
    """A fused experts module's gate on its ``gate_up`` GEMM's output: the module's own
    ``_apply_gate`` (HF's experts decorator adds one; gpt-oss's interleaves and clamps), else
    ``act_fn(gate) * up`` over the two halves. Every computation of the experts uses this one."""
    apply_gate = getattr(module, "_apply_gate", None)
    if callable(apply_gate):
        return apply_gate(gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def is_tuner_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA's and the others'), by shape, so that no package imports peft
    to ask: it holds the module it replaced as ``base_layer``."""
    return isinstance(module._modules.get("base_layer"), nn.Module)
