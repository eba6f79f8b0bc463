"""MoE telemetry: how the router spread the tokens over the experts, per MoE layer, per step.

Counted where the choices are used, so every dispatcher and every layout sees the same thing:

- a forward pre-hook on each expert container (the model facts' ``experts``) counts the slots
  routed to each expert from its ``top_k_index`` argument (under its name or an alias, or the
  second positional argument), and the slots routed to an id ``>= num_experts`` (dropped);
- a forward hook on each router (the facts' ``routers``) takes its first output with one column
  per expert as logits, and sums the entropy of their softmax over the tokens.

:meth:`MoETelemetry.read` sums the counts of every rank (one all-reduce, on every rank: a
collective) and returns, per layer and over the layers:

- ``load``: each expert's share of the routed slots, and ``imbalance``: the busiest expert's
  load over the mean (1.0 is perfectly even);
- ``ep_rank_share`` / ``ep_imbalance``: the same per EP rank (each holds ``E / ep`` consecutive
  experts), when expert parallel splits the experts;
- ``router_entropy``: the mean entropy of the routers' softmax, over ``log(num_experts)`` (1.0
  is uniform routing, 0 a certain one);
- ``dropped``: the share of slots routed to no expert. Nothing is padded: no dispatcher here has
  a capacity;
- ``ep_rank_share_balanced`` / ``ep_imbalance_balanced``: where a container computes some
  experts' rows on other ranks than theirs (redundant experts), the rows each EP rank really
  computed. Such a container has ``moe_rank_rows()``: the rows of its last forward per EP rank.

Shares and ratios do not depend on how many ranks see the same token (tensor parallel without
sequence parallel), so the sum over every rank is enough. Counts reset after each read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp_turbo.core.model_inspect import EXPERT_FORWARD_ALIASES
from fsdp_turbo.core.stage_part import in_metadata_inference, stage_parts

_INDEX = "top_k_index"


@dataclass
class _LayerCounts:
    """One layer's counts since the last read, kept on the device the routing ran on (no sync per layer)."""

    num_experts: int
    slots: torch.Tensor  # [num_experts + 1]: routed slots per expert, then the dropped ones
    entropy: torch.Tensor  # [1]: summed over the tokens the routers saw
    tokens: int = 0
    balanced: torch.Tensor | None = None  # [ep]: rows each EP rank computed (redundant experts), else None
    handles: list = field(default_factory=list)

    @property
    def size(self) -> int:  # entries of packed()
        return self.num_experts + 3 + (0 if self.balanced is None else self.balanced.numel())

    def add_rank_rows(self, rows: list[int]) -> None:
        self.balanced = self.balanced + torch.tensor(rows, dtype=torch.int64)

    def add_slots(self, index: torch.Tensor) -> None:
        flat = index.detach().reshape(-1).clamp(max=self.num_experts)
        self.slots = self.slots.to(flat.device) + torch.bincount(flat, minlength=self.num_experts + 1)

    def add_entropy(self, logits: torch.Tensor) -> None:
        logits = logits.detach().float().reshape(-1, self.num_experts)
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum()
        self.entropy = self.entropy.to(entropy.device) + entropy
        self.tokens += logits.shape[0]

    def packed(self, device: torch.device | str) -> torch.Tensor:
        balanced = () if self.balanced is None else (self.balanced.to(device, torch.float64),)
        return torch.cat([self.slots.to(device, torch.float64), self.entropy.to(device, torch.float64),
                          torch.tensor([self.tokens], dtype=torch.float64, device=device), *balanced])

    def reset(self) -> None:
        self.slots, self.entropy, self.tokens = torch.zeros_like(self.slots), torch.zeros_like(self.entropy), 0
        if self.balanced is not None:
            self.balanced = torch.zeros_like(self.balanced)


def _top_k_index(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``[tokens, top_k]`` expert ids of an experts call, if it takes them (a form called
    with per-expert token counts instead, as torchtitan's, is not counted)."""
    index = next((value for name, value in kwargs.items() if EXPERT_FORWARD_ALIASES.get(name, name) == _INDEX),
                 args[1] if len(args) > 1 else None)
    if isinstance(index, torch.Tensor) and index.dim() >= 2 and not index.is_floating_point():
        return index
    return None


def _num_experts(module: nn.Module) -> int | None:
    weight = getattr(module, "gate_up_proj", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 3:
        return weight.shape[0]
    if isinstance(module, nn.ModuleList):
        return len(module)
    return getattr(module, "num_experts", None)


class MoETelemetry:
    """Counts the routing of ``model``'s MoE layers (see the module docstring). ``experts``:
    the expert containers' names; ``routers``: the routers' names, each matched to the layer of
    the expert container that shares its parent; ``ep``: expert parallel's size."""

    def __init__(self, model: nn.Module, experts: tuple[str, ...], routers: tuple[str, ...] = (), ep: int = 1,
                 group: dist.ProcessGroup | None = None) -> None:
        self.ep, self.group = ep, group  # group: the ranks that hold these layers (default: every rank)
        self.layers: dict[str, _LayerCounts] = {}
        for name in experts:
            module = model.get_submodule(name)
            count = _num_experts(module)
            if count is None:
                continue
            layer = _LayerCounts(count, torch.zeros(count + 1, dtype=torch.int64), torch.zeros(1))
            layer.handles.append(module.register_forward_pre_hook(self._count_slots(layer), with_kwargs=True))
            rank_rows = getattr(module, "moe_rank_rows", None)
            if callable(rank_rows) and rank_rows() is not None:
                layer.balanced = torch.zeros(len(rank_rows()), dtype=torch.int64)
                layer.handles.append(module.register_forward_hook(lambda m, a, o, layer=layer:
                                                                  layer.add_rank_rows(m.moe_rank_rows())))
            self.layers[name.rpartition(".")[0]] = layer
        for name in routers:
            layer = self.layers.get(name.rpartition(".")[0])
            if layer is not None:
                layer.handles.append(model.get_submodule(name).register_forward_hook(self._router_entropy(layer)))

    @staticmethod
    def _count_slots(layer: _LayerCounts):
        def hook(module, args, kwargs):
            if in_metadata_inference():
                return
            index = _top_k_index(args, kwargs)
            if index is not None:
                layer.add_slots(index)
        return hook

    @staticmethod
    def _router_entropy(layer: _LayerCounts):
        def hook(module, args, output):
            if in_metadata_inference():
                return
            logits = output[0] if isinstance(output, tuple) else output
            if isinstance(logits, torch.Tensor) and logits.shape[-1] == layer.num_experts:
                layer.add_entropy(logits)
        return hook

    def read(self, device: torch.device | str = "cpu") -> dict[str, object]:
        """Every layer's routing since the last read, summed over every rank; then reset.
        A collective where a process group is initialized: every rank calls it."""
        if not self.layers:
            return {}
        packed = torch.cat([layer.packed(device) for layer in self.layers.values()])
        if dist.is_initialized():
            dist.all_reduce(packed, group=self.group)
        packed, row, offset = packed.cpu(), {}, 0
        for name, layer in self.layers.items():
            size = layer.size
            row.update(_layer_row(name, packed[offset:offset + size], layer.num_experts, self.ep))
            offset += size
            layer.reset()
        return _with_summary(row)

    def remove(self) -> None:
        for layer in self.layers.values():
            for handle in layer.handles:
                handle.remove()


def _with_summary(row: dict[str, object]) -> dict[str, object]:
    """``row`` with the figures over its layers: the largest imbalance, the mean entropy."""
    imbalances = [value for key, value in row.items() if key.endswith("/imbalance")]
    entropies = [value for key, value in row.items() if key.endswith("/router_entropy")]
    if imbalances:
        row["moe/imbalance_max"] = max(imbalances)
    if entropies:
        row["moe/router_entropy_mean"] = sum(entropies) / len(entropies)
    return row


class StagesTelemetry:
    """The telemetry of a pipelined model: each stage's layers are counted where they run,
    summed over the ranks holding the same stages, and the rows of every stage are gathered
    over the pipeline (``read`` is a collective, as :meth:`MoETelemetry.read`)."""

    def __init__(self, stages: list[MoETelemetry], pipeline: dist.ProcessGroup) -> None:
        self.stages, self.pipeline = stages, pipeline

    def read(self, device: torch.device | str = "cpu") -> dict[str, object]:
        mine: dict[str, object] = {}
        for stage in self.stages:
            mine.update({k: v for k, v in stage.read(device).items() if k not in _SUMMARY})
        every: list[dict[str, object] | None] = [None] * dist.get_world_size(self.pipeline)
        dist.all_gather_object(every, mine, group=self.pipeline)
        return _with_summary({key: value for row in every for key, value in (row or {}).items()})

    def remove(self) -> None:
        for stage in self.stages:
            stage.remove()


_SUMMARY = ("moe/imbalance_max", "moe/router_entropy_mean")


def _layer_row(name: str, packed: torch.Tensor, num_experts: int, ep: int) -> dict[str, object]:
    slots, dropped = packed[:num_experts], float(packed[num_experts])
    entropy, tokens = float(packed[num_experts + 1]), float(packed[num_experts + 2])
    routed = float(slots.sum())
    prefix = f"moe/{name}"
    row: dict[str, object] = {f"{prefix}/dropped": dropped / (routed + dropped) if routed + dropped else 0.0}
    if routed:
        share = slots / routed
        row[f"{prefix}/load"] = [round(float(s), 6) for s in share]
        row[f"{prefix}/imbalance"] = float(share.max() * num_experts)
        if ep > 1 and num_experts % ep == 0:
            ranks = share.view(ep, -1).sum(1)
            row[f"{prefix}/ep_rank_share"] = [round(float(s), 6) for s in ranks]
            row[f"{prefix}/ep_imbalance"] = float(ranks.max() * ep)
    if tokens:
        row[f"{prefix}/router_entropy"] = entropy / tokens / math.log(num_experts)
    balanced = packed[num_experts + 3:]
    if balanced.numel() and float(balanced.sum()):
        ranks = balanced / balanced.sum()
        row[f"{prefix}/ep_rank_share_balanced"] = [round(float(s), 6) for s in ranks]
        row[f"{prefix}/ep_imbalance_balanced"] = float(ranks.max() * ranks.numel())
    return row


def telemetry_of(model: nn.Module) -> MoETelemetry | None:
    """The telemetry of a model ``FSDPTurbo`` made (its facts name the expert containers and
    routers; its parallel state the EP size); ``None`` for a dense model."""
    state = model.parallel_state
    if getattr(model, "fsdp_turbo_pipeline", None) is not None:
        # every stage's own facts; counted over the ranks that hold the same stages
        stage_ranks = state.group(*(dim for dim in state.sizes.dense_dims if dim != "pp"))
        stages = [MoETelemetry(part, tuple(c.name for c in part.fsdp_turbo_facts.experts),
                               part.fsdp_turbo_facts.routers, ep=state.sizes.ep, group=stage_ranks)
                  for part in stage_parts(model)]
        # the whole model's facts decide (a stage may hold no MoE layer while another does)
        whole = model.fsdp_turbo_pipeline.plan.model_facts
        return StagesTelemetry(stages, state.group("pp")) if whole.experts else None
    facts = model.fsdp_turbo_facts
    if not facts.experts:
        return None
    return MoETelemetry(model, tuple(container.name for container in facts.experts), facts.routers,
                        ep=state.sizes.ep)



def scalars(row: dict[str, object]) -> dict[str, float]:
    """The figures of a :meth:`MoETelemetry.read` row that are single numbers (for loggers that take scalars)."""
    return {name: value for name, value in row.items() if isinstance(value, float)}
