"""DeepSeek-V3's auxiliary-loss-free load balancing (``router_bias_update_rate``).

The routers of DeepSeek-V3 and its kin (GLM-4.5 MoE, Kimi, ...) choose experts by their scores
plus a per-expert bias, ``e_score_correction_bias``, that the routing weights do not see. HF's
models keep it fixed (inference). With a rate ``gamma`` it is trained as the paper says: after
every training forward of a layer, each expert's bias moves by ``gamma`` towards balance,

    bias[e] += gamma * sign(mean load - load[e])

with the loads counted from the slots routed to each expert in that forward, summed over every
rank (one all-reduce of ``num_experts`` integers per layer). The sign is the same whichever ranks
see a token twice (tensor parallel), so the sum over the whole world is enough, and the counts
are integers: every rank, and the one-process run of the same global batch, moves the bias
alike. The bias is a buffer of the model: checkpoints carry it.

When. The counts are taken where the experts are called (their ``top_k_index``), after the
router ran, and the bias moves right away, for the next forward. A forward inside the backward
(recompute) must route as its original forward did: the router then runs with the bias that
forward used (kept at each training forward), and nothing is counted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.autograd_state import in_backward
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_inspect import EXPERT_FORWARD_ALIASES

BIAS = "e_score_correction_bias"
FIELD = "router_bias_update_rate"


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def biased_routers(model: nn.Module, experts: tuple[str, ...]) -> list[tuple[nn.Module, nn.Module]]:
    """``(expert container, router)`` of each MoE block whose router has a ``e_score_correction_bias``:
    the router is the module of the container's block (its parent) that holds the buffer."""
    pairs = []
    for name in experts:
        block = model.get_submodule(_parent(name))
        routers = [m for n, m in block.named_modules() if isinstance(getattr(m, BIAS, None), torch.Tensor)
                   and not n.startswith(name.rsplit(".", 1)[-1])]
        if len(routers) == 1:
            pairs.append((model.get_submodule(name), routers[0]))
    return pairs


def check_biased_routers(model: nn.Module, experts: tuple[str, ...], rate: float) -> None:
    """``ConfigError`` when the rate is set and no MoE block has a router with the bias."""
    if rate and not biased_routers(model, experts):
        raise ConfigError(FIELD, rate, "set it to 0: it needs routers with an e_score_correction_bias "
                          "(DeepSeek-V3, GLM-4.5 MoE, Kimi K2 style)",
                          reason=f"no router beside the expert containers {list(experts)[:2]} has one")


def _slots(args: tuple, kwargs: dict) -> torch.Tensor | None:
    index = next((v for k, v in kwargs.items() if EXPERT_FORWARD_ALIASES.get(k, k) == "top_k_index"),
                 args[1] if len(args) > 1 else None)
    return index if isinstance(index, torch.Tensor) and not index.is_floating_point() else None


class RouterBiasBalancer:
    """The hooks that train the routers' biases; :meth:`remove` takes them off."""

    def __init__(self, pairs: list[tuple[nn.Module, nn.Module]], rate: float,
                 group: dist.ProcessGroup | None = None) -> None:
        self.rate, self.group, self.handles = rate, group, []
        for container, router in pairs:
            self._attach(container, router)

    def _attach(self, container: nn.Module, router: nn.Module) -> None:
        used: dict[str, torch.Tensor] = {}  # the bias of the last training forward, and the live one while recomputing

        def before_router(module, args):
            bias = getattr(module, BIAS)
            if in_backward() and "forward" in used:
                used["live"] = bias.detach().clone()
                bias.data.copy_(used["forward"])
            elif module.training and torch.is_grad_enabled():
                used["forward"] = bias.detach().clone()

        def after_router(module, args, output):
            if "live" in used:
                getattr(module, BIAS).data.copy_(used.pop("live"))

        def before_experts(module, args, kwargs):
            index = _slots(args, kwargs)
            if index is None or not (module.training and torch.is_grad_enabled()) or in_backward():
                return
            self.update(getattr(router, BIAS), index)

        self.handles += [router.register_forward_pre_hook(before_router),
                         router.register_forward_hook(after_router),
                         container.register_forward_pre_hook(before_experts, with_kwargs=True)]

    def update(self, bias: torch.Tensor, index: torch.Tensor) -> None:
        """Move ``bias`` by the rate towards balance, from the slots ``index`` routed (every rank's)."""
        num_experts = bias.numel()
        load = torch.bincount(index.reshape(-1).clamp(max=num_experts), minlength=num_experts + 1)[:num_experts]
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load, group=self.group)
        # sign(mean - load) in integers: mean * E = total
        step = torch.sign(load.sum() - load * num_experts).to(bias.dtype)
        with torch.no_grad():
            bias.add_(step.to(bias.device), alpha=self.rate)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
