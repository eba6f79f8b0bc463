"""Rank functions for the expert-parallel tests (importable by the spawned ranks)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fsdp_turbo.core.testing import TrainRecord, full_tensor, full_tensors, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm, to_expert_lists


def build_model(kind: str, model_kwargs=None, expert_lists: bool = False) -> nn.Module:
    model = tiny_hf_causal_lm(kind, **(model_kwargs or {}))
    return to_expert_lists(model) if expert_lists else model


def reference_run(kind, batches, model_kwargs=None, expert_lists=False):
    return train_steps(build_model(kind, model_kwargs, expert_lists), batches)


def fixed_router_reference_run(kind, batches):
    """The one-process model routed by position, as ``ep_plan.fixed_router`` routes: a pre-hook on
    each experts container replaces the router's choices with ``routing.fixed_routing``'s."""
    from fsdp_turbo.distributed.expert_parallel.routing import fixed_routing

    def by_position(module, args):
        hidden_states, top_k_index, top_k_weights = args
        return (hidden_states, *fixed_routing(top_k_index, top_k_weights, module.gate_up_proj.shape[0]))

    model = build_model(kind)
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(by_position)
    return train_steps(model, batches)


def router_bias_reference_run(kind, batches, rate):
    """The one-process model whose routers' ``e_score_correction_bias`` trains as
    ``router_bias_update_rate`` trains it (``core.router_bias``), on the whole batch."""
    from fsdp_turbo.core.router_bias import RouterBiasBalancer, biased_routers

    model = build_model(kind)
    experts = tuple(n for n, _ in model.named_modules() if n.endswith("mlp.experts"))
    RouterBiasBalancer(biased_routers(model, experts), rate)
    record = train_steps(model, batches)
    record.biases = router_biases(model)
    return record


def router_biases(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def accumulated_reference(kind, batches, shards, model_kwargs=None):
    """The data-parallel reference for a per-batch nonlinear loss (the router's auxiliary
    loss): each step averages the loss and gradients of the ``shards`` data shards."""
    model = build_model(kind, model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    record = TrainRecord()
    for step, batch in enumerate(batches):
        total = 0.0
        for shard in range(shards):
            rows = shard_rows(batch, shard, shards)
            loss = model(input_ids=rows, labels=rows).loss / shards
            loss.backward()
            total += float(loss)
        record.losses.append(total)
        if step == 0:
            record.grads = full_tensors({n: p.grad for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


def _expert_facts(model) -> dict:
    from torch.distributed.tensor import DTensor

    facts = {}
    for name, param in model.named_parameters():
        if ".experts." in name:
            local = param.to_local() if isinstance(param, DTensor) else param
            placements = str(param.placements) if isinstance(param, DTensor) else None
            facts[name] = (tuple(local.shape), placements)
    return facts


def ep_run(kind, batches, config, model_kwargs=None, expert_lists=False):
    """Train through the facade; return the record, expert parameter facts and class name."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, build_model(kind, model_kwargs, expert_lists))
    state = model.parallel_state
    facts = _expert_facts(model)
    record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in batches])
    experts_class = next(type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts"))
    return record, facts, experts_class


def replica_slots_routed(model) -> int:
    """Slots this rank routed to replica slots so far (``ep_plan.redundant_experts``), every layer."""
    from fsdp_turbo.distributed.expert_parallel.replicas import replicas_of

    return sum(r.routed_to_replicas for m in model.modules() if (r := replicas_of(m)) is not None)


def ep_runs(runs, batches):
    """Several facade trainings in one launch: for each ``(kind, config)``, ``ep_run``'s record,
    expert facts and class, and the slots routed to replicas. ``(kind, config, "recompute")``
    turns on transformers' own gradient checkpointing of the decoder layers first (turbo-memory's
    recompute is not installed here): each layer's forward runs again inside the backward."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = []
    for kind, config, *options in runs:
        model = build_model(kind)
        if "recompute" in options:
            model.gradient_checkpointing_enable()
        model = FSDPTurbo(config, model)
        state = model.parallel_state
        facts = _expert_facts(model)
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in batches])
        experts_class = next(type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts"))
        record.biases = router_biases(model)
        results.append((record, facts, experts_class, replica_slots_routed(model)))
    return results


def merge_rank_grads(records) -> dict[str, torch.Tensor]:
    """Every rank's gradients in one dict (a ModuleList expert lives on its owner's ranks)."""
    merged: dict[str, torch.Tensor] = {}
    for record in records:
        merged.update(record.grads)
    return merged


# ----- one experts module, hand-made uneven routing ------------------------------------
ROUTES = {
    # rank: (top_k_index rows). Rank 0 keeps everything on its own experts (sends nothing to
    # rank 1) and drops one slot (id 8); rank 1 uses experts 0 and 5 only. Experts 2, 3, 4,
    # 6 and 7 get no tokens at all.
    0: [[0, 1], [1, 0], [0, 8], [1, 0], [0, 1], [1, 0]],
    1: [[5, 0], [0, 5], [5, 0], [5, 0], [0, 5]],
}


class _Holder(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


def _experts_module(form: str) -> nn.Module:
    experts = tiny_hf_causal_lm("qwen3_moe").model.layers[0].mlp.experts
    # HF's eager experts skip a dropped slot (id == num_experts); its grouped_mm path leaves
    # that row undefined unless the module is marked expert-parallel.
    experts.config._experts_implementation = "eager"
    if form == "list":
        holder = nn.Module()
        holder.mlp = nn.Module()
        holder.mlp.experts = experts
        experts = to_expert_lists(holder).mlp.experts
    return experts


def _inputs(rank: int, hidden: int):
    generator = torch.Generator().manual_seed(100 + rank)
    index = torch.tensor(ROUTES[rank])
    states = torch.randn(index.shape[0], hidden, generator=generator, requires_grad=True)
    weights = torch.rand(index.shape, generator=generator, requires_grad=True)
    return states, index, weights


def _run(module: nn.Module, rank: int, hidden: int):
    states, index, weights = _inputs(rank, hidden)
    out = module(states, index, weights)
    out.backward(torch.ones_like(out))
    return out.detach(), states.grad, weights.grad


def uneven_dispatch_runs(cases) -> list[dict]:
    """``uneven_dispatch_run`` for each ``(dispatcher, form, redundant_experts)``, in one launch."""
    return [uneven_dispatch_run(*case) for case in cases]


def uneven_dispatch_run(dispatcher: str, form: str, spare: int = 0) -> dict:
    """Compare one EP=2 experts module with the unsharded one on hand-made routing; with
    ``spare`` replica slots per rank, placed from this forward's load."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.expert_parallel import apply_expert_parallel
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    rank = dist.get_rank()
    reference = _experts_module(form)
    hidden = 64
    sharded = _Holder(copy.deepcopy(reference))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    apply_expert_parallel(sharded, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher, num_chunks=3,
                                                redundant_experts=spare, rebalance_every=1), mesh)
    expected, got = _run(reference, rank, hidden), _run(sharded.experts, rank, hidden)
    # Expert gradients sum every rank's tokens: all-reduce the reference's.
    reference_grads = {}
    for name, param in reference.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        reference_grads[name] = grad
    local_grads = {}
    for name, param in sharded.experts.named_parameters():
        local_grads[name] = full_tensor(param.grad)
    return {"expected": expected, "got": got, "reference_grads": reference_grads, "local_grads": local_grads,
            "to_replicas": replica_slots_routed(sharded)}


def checkpoint_round_trip_run(kind, batches, config, directory, resume_config=None):
    """Train one step, save with DCP, load into a fresh EP model (``resume_config``'s layout;
    unset: the same), and evaluate on: the original's and the resumed model's next losses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    def fresh(config=config):
        model = FSDPTurbo(config, build_model(kind))
        state = model.parallel_state
        return model, [shard_rows(b, state.dp_rank, state.dp_size) for b in batches]

    model, local = fresh()
    train_steps(model, local[:1], record_grads=False)
    dcp.save(get_model_state_dict(model), checkpoint_id=directory)
    expected = [float(model(input_ids=b, labels=b).loss) for b in local[1:]]
    resumed, local = fresh(resume_config or config)
    expected = [float(model(input_ids=b, labels=b).loss) for b in local[1:]] if resume_config else expected
    state_dict = get_model_state_dict(resumed)
    dcp.load(state_dict, checkpoint_id=directory)
    set_model_state_dict(resumed, state_dict)
    got = [float(resumed(input_ids=b, labels=b).loss) for b in local[1:]]
    full = {n: full_tensor(p) for n, p in resumed.named_parameters() if ".experts." in n}
    return expected, got, full


def both_round_trips_run(kind, batches, config, trained, resumed, directory):
    """``checkpoint_round_trip_run`` at one layout, then from ``trained`` to ``resumed``."""
    return (checkpoint_round_trip_run(kind, batches, config, f"{directory}/same"),
            checkpoint_round_trip_run(kind, batches, trained, f"{directory}/other", resumed))


# ----- the domino dispatcher --------------------------------------------------------
def dispatcher_records_run(kind, batches, configs, expert_lists=False):
    """Several facade trainings in one launch: ``ep_run`` for each config, in order."""
    return [ep_run(kind, batches, config, None, expert_lists) for config in configs]


def _routed_inputs(rows: list[list[int]], hidden: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    index = torch.tensor(rows, dtype=torch.long).reshape(len(rows), 2)
    states = torch.randn(index.shape[0], hidden, generator=generator, requires_grad=True)
    weights = torch.rand(index.shape, generator=generator, requires_grad=True)
    return states, index, weights


def _ep2_experts(form: str, dispatcher: str, num_chunks: int):
    """The unsharded experts module and an EP=2 copy of it (``dispatcher``, ``num_chunks``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.expert_parallel import apply_expert_parallel
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    reference = _experts_module(form)
    sharded = _Holder(copy.deepcopy(reference))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    plan = EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher, num_chunks=num_chunks)
    apply_expert_parallel(sharded, plan, mesh)
    return reference, sharded.experts


def _forward_backward(module: nn.Module, rows: list[list[int]], seed: int):
    states, index, weights = _routed_inputs(rows, 64, seed)
    out = module(states, index, weights)
    out.backward(torch.ones_like(out))
    return out.detach(), states.grad, weights.grad


def routed_against_whole_run(dispatcher: str, form: str, routes: dict, num_chunks: int) -> dict:
    """EP=2 experts against the unsharded module on hand-made routing ``routes[rank]``: the
    output, the input and routing-weight gradients, and every local expert's gradient (the
    reference's summed over ranks, as the all-to-all's backward sums them)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    reference, sharded = _ep2_experts(form, dispatcher, num_chunks)
    expected = _forward_backward(reference, routes[rank], seed=200 + rank)
    got = _forward_backward(sharded, routes[rank], seed=200 + rank)
    reference_grads = {}
    for name, param in reference.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad)
        reference_grads[name] = grad
    local_grads = {name: full_tensor(param.grad) for name, param in sharded.named_parameters()}
    return {"expected": expected, "got": got, "reference_grads": reference_grads, "local_grads": local_grads}


def domino_events_run(tokens: int, num_chunks: int) -> dict[str, list[tuple[str, int]]]:
    """The domino schedule's events on EP=2 experts: one forward, then one backward."""
    import torch.distributed as dist

    from fsdp_turbo.distributed.expert_parallel.domino import event_hook

    _, sharded = _ep2_experts("fused", "domino", num_chunks)
    generator = torch.Generator().manual_seed(300 + dist.get_rank())
    # Every token visits one expert of each rank, so every slice sends rows both ways.
    index = torch.stack([torch.randint(0, 4, (tokens,), generator=generator),
                         torch.randint(4, 8, (tokens,), generator=generator)], dim=1)
    states = torch.randn(tokens, 64, generator=generator, requires_grad=True)
    weights = torch.rand(index.shape, generator=generator, requires_grad=True)
    log: dict[str, list[tuple[str, int]]] = {"forward": [], "backward": []}
    with event_hook(lambda event, index: log["forward"].append((event, index))):
        out = sharded(states, index, weights)
    with event_hook(lambda event, index: log["backward"].append((event, index))):
        out.sum().backward()
    return log


def domino_two_rank_run(batches, tiny_routes: dict) -> dict:
    """Every 2-rank domino check in one launch (each builds its own models and mesh):
    facade training (Mixtral, 3 slices; a ModuleList of experts), domino and fused each;
    hand-made uneven routing in both forms; slices with no token; the schedule's events."""
    domino = {"expert_parallel_size": 2, "ep_plan": {"dispatcher": "domino", "num_chunks": 3}}
    fused = {"expert_parallel_size": 2, "ep_plan": {"dispatcher": "fused"}}
    return {
        "mixtral": dispatcher_records_run("mixtral", batches, [domino, fused]),
        "expert_lists": dispatcher_records_run("qwen3_moe", batches, [domino, fused], expert_lists=True),
        "uneven": {form: routed_against_whole_run("domino", form, ROUTES, 3) for form in ("fused", "list")},
        "tiny": routed_against_whole_run("domino", "fused", tiny_routes, 4),
        "events": {chunks: domino_events_run(tokens=12, num_chunks=chunks) for chunks in (2, 3)},
    }
