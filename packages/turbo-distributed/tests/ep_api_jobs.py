"""Rank functions for the module-API tests: the calls LLaMA-Factory's ``fsdpturbo`` backend makes.

The caller owns everything but the experts: the process group, its own data-parallel mesh
and outer FSDP2 (the decoder layers and the root, expert parameters ignored), and a 4-D
expert mesh ``(edp, efsdp, ep, expert_cp)`` of its own, passed as 1-D slices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ep_jobs import build_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import shard_rows, train_steps
from fsdp_turbo.distributed.expert_parallel import DISPATCHERS
from fsdp_turbo.distributed.expert_parallel.expert_fully_shard_parallel import expert_fully_shard_modules
from fsdp_turbo.distributed.expert_parallel.expert_parallel import expert_parallelize_modules
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig, FSDPPlanConfig
from fsdp_turbo.utils.str_match import module_name_match

EP_MODULES = ["model.layers.{*}.mlp.experts"]
EFSDP_MODULES = ["model.layers.{*}.mlp"]  # holds the router too: the trap


def expert_meshes(ep: int):
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world // ep, ep, 1), mesh_dim_names=("edp", "efsdp", "ep", "expert_cp"))
    return mesh["efsdp"], mesh["ep"]


def client_model(kind, ep, efsdp_mesh, ep_mesh, dispatcher, *, client_factor=True, hook_modules=(),
                 efsdp_modules=EFSDP_MODULES):
    """The client's ``prepare_model_ep`` then its outer FSDP2, with the real functions."""
    model = build_model(kind)
    plan = EPPlanConfig(apply_modules=EP_MODULES, dispatcher=dispatcher, apply_efsdp_modules=efsdp_modules)
    if client_factor:
        plan.gradient_divide_factor = float(ep * efsdp_mesh.size())
    fsdp_plan = FSDPPlanConfig(apply_modules={}, hook_modules=list(hook_modules), fsdp_implementation="native")
    model = expert_parallelize_modules(model, ep_mesh, plan)
    if efsdp_mesh.size() > 1:
        model = expert_fully_shard_modules(model, efsdp_mesh, plan, fsdp_plan)
    ignored = {p for name, module in model.named_modules() for pattern in EP_MODULES
               if module_name_match(pattern, name) for p in module.parameters()}
    dp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, ignored_params=ignored)
    fully_shard(model, mesh=dp_mesh, ignored_params=ignored)
    return model


def _train(model, batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    return train_steps(model, [shard_rows(b, rank, world) for b in batches])


def _router_mesh(model) -> tuple[str, ...]:
    grad_owner = model.model.layers[0].mlp.gate.weight
    return tuple(grad_owner.device_mesh.mesh_dim_names)


def _gathered_at_attention(model) -> list[bool]:
    """Whether each layer's experts are all-gathering (or gathered) when its attention starts."""
    seen = []
    for layer in model.model.layers:
        group = layer.mlp.experts._get_fsdp_state()._fsdp_param_group

        def record(_module, _args, group=group):
            seen.append(group._all_gather_result is not None or group.is_unsharded)
        layer.self_attn.register_forward_pre_hook(record)
    return seen


def api_runs(kind, batches, ep_sizes):
    """Each dispatcher at each EP size on this world (efsdp = world / ep), the client's divide
    factor; then, at the first EP size, the default factor and hook modules."""
    results = {}
    for ep in ep_sizes:
        efsdp_mesh, ep_mesh = expert_meshes(ep)
        for dispatcher in sorted(DISPATCHERS):
            model = client_model(kind, ep, efsdp_mesh, ep_mesh, dispatcher)
            results[(ep, dispatcher)] = _train(model, batches)
        if ep == ep_sizes[0]:
            results[(ep, "default factor")] = _train(
                client_model(kind, ep, efsdp_mesh, ep_mesh, "fused", client_factor=False), batches)
            results["router mesh"] = _router_mesh(model)
            results["experts class"] = type(model.model.layers[0].mlp.experts).__name__
            results["mlp class"] = type(model.model.layers[0].mlp).__name__
            if efsdp_mesh.size() > 1:
                for hooks in ((), ("model.layers.*",)):
                    model = client_model(kind, ep, efsdp_mesh, ep_mesh, "fused", hook_modules=hooks)
                    seen = _gathered_at_attention(model)
                    results[("hooks", hooks)] = (_train(model, batches[:1]), seen[: len(model.model.layers)])
    return results


def api_errors() -> dict[str, str]:
    """Bad calls, each a ConfigError raised before any collective, on every rank."""
    efsdp_mesh, ep_mesh = expert_meshes(2)
    two_d = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("a", "b"))
    plan = EPPlanConfig(apply_modules=EP_MODULES)
    calls = {
        "2-D ep mesh": lambda: expert_parallelize_modules(build_model("qwen3_moe"), two_d, plan),
        "fully shard first": lambda: expert_fully_shard_modules(build_model("qwen3_moe"), efsdp_mesh, plan),
        "no expert in target": lambda: expert_fully_shard_modules(
            expert_parallelize_modules(build_model("qwen3_moe"), ep_mesh, plan), efsdp_mesh,
            EPPlanConfig(apply_modules=EP_MODULES, apply_efsdp_modules=["model.layers.{*}.self_attn"])),
        "a container left out": lambda: expert_fully_shard_modules(
            expert_parallelize_modules(build_model("qwen3_moe"), ep_mesh, plan), efsdp_mesh,
            EPPlanConfig(apply_modules=EP_MODULES, apply_efsdp_modules=["model.layers.0.mlp"])),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
        except ConfigError as error:
            errors[name] = str(error)
    dist.barrier()  # every rank got here: nothing above hung on a collective
    return errors


def grad_divided_once(factor: float) -> bool:
    """Gradient accumulation over two micro-batches: the hook divides each, not the sum twice."""
    _efsdp, ep_mesh = expert_meshes(dist.get_world_size())
    model = expert_parallelize_modules(build_model("qwen3_moe"), ep_mesh,
                                       EPPlanConfig(apply_modules=EP_MODULES, gradient_divide_factor=factor))
    experts = model.model.layers[0].mlp.experts
    batch = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=batch, labels=batch).loss.backward()
    once = experts.gate_up_proj.grad.to_local().clone()
    model(input_ids=batch, labels=batch).loss.backward()
    return torch.allclose(experts.gate_up_proj.grad.to_local(), 2 * once, rtol=1e-6, atol=0)
