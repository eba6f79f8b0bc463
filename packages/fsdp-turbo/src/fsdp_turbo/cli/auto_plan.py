"""``fsdp-turbo plan --auto``: the layouts and memory features that fit a memory budget,
ranked by a stated cost model.

The search tries every split of the world into ``dp_replicate x fsdp x cp x tp`` (TP where
the job has a ``tp_plan`` or the model's config names one), every expert-parallel size that
divides the experts (MoE models), recompute off / selective / full, the chunked loss off /
on, the optimizer and activation swaps off / on (accelerators only: on CPU the host is the
device), and each micro-batch that keeps the job's global batch. Each candidate is planned
by the same planner ``train`` runs (``plan.plan_job``): a layout the library refuses is not
a candidate (they are counted), and its memory is the estimate ``plan`` prints
(``core.memory_estimate``).

The cost of a step on one rank, in seconds, is the sum of three terms (no overlap assumed):

- ``compute``: ``6 x active parameters x tokens + 6 x layers x seq x q_dim x tokens``
  (causal attention) FLOPs for the rank's share of the global batch, over ``--flops``;
  full recompute adds one forward of the layers (a third of their FLOPs);
- ``communication``: bytes each rank receives over ``--link-bandwidth``: FSDP's all-gathers
  (as ``plan`` counts them) and reduce-scatters every micro-batch, HSDP's all-reduce of the
  gradient shards, TP's activations (8 x tokens x H a layer: the forward and backward
  collectives of attention and MLP), CP's keys and values (3 x 2 x kv a token and layer:
  forward gather, backward gather and gradient), EP's dispatch and combine (4 x top_k x H
  a token and MoE layer);
- ``memory traffic``: selective recompute re-runs the elementwise ops (their activations
  written again, over ``--memory-bandwidth``); the optimizer swap moves the AdamW states to
  the device and back every step, the activation swap the layers' saved activations every
  micro-batch (over ``--host-bandwidth``).

Among the candidates whose predicted peak fits ``--memory-per-rank``, the fastest wins;
ties go to the smaller peak.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.model import build_model
from fsdp_turbo.cli.plan import Planned, plan_job
from fsdp_turbo.cli.sizes import job_sizes
from fsdp_turbo.core.device import detect_device_type
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.memory_estimate import FP32
from fsdp_turbo.core.patterns import match_modules

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, field: str = "--memory-per-rank") -> int:
    """``'80GiB'``, ``'120 MiB'``, ``'1.5e9'`` -> bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else ""
    if found is None or unit not in _UNITS:
        raise ConfigError(field, text, "give bytes with an optional unit, e.g. 80GiB, 120MiB or 2e9",
                          reason="it is not a size")
    return int(float(found.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Hardware:
    """What the cost model assumes of each rank (the flags' values)."""

    flops: float = 400e12  # dense FLOP/s one rank sustains
    link: float = 50e9  # bytes/s a rank receives over the collectives' links
    memory: float = 2e12  # device memory bytes/s
    host: float = 25e9  # bytes/s between device and host memory


@dataclass(frozen=True)
class Choice:
    """One candidate: the parallel sizes, the memory features and the micro-batch."""

    dp: int
    fsdp: int
    cp: int
    tp: int
    ep: int
    recompute: str | None
    chunk_loss: bool
    swap_optimizer: bool
    swap_activation: bool
    micro_batch: int
    grad_accum: int

    def describe(self) -> str:
        sizes = " x ".join(f"{name}{size}" for name, size in (("dp", self.dp), ("fsdp", self.fsdp), ("cp", self.cp),
                                                             ("tp", self.tp), ("ep", self.ep)) if size > 1)
        features = [f"recompute {self.recompute}" if self.recompute else "", "chunked loss" if self.chunk_loss else "",
                    "optimizer swap" if self.swap_optimizer else "",
                    "activation swap" if self.swap_activation else ""]
        return ", ".join([sizes or "fsdp1", *filter(None, features),
                          f"micro-batch {self.micro_batch} x {self.grad_accum}"])


@dataclass(frozen=True)
class Candidate:
    choice: Choice
    turbo: dict[str, Any]  # the FSDPTurbo config section
    run: dict[str, Any]  # the job's run section with this micro-batch
    peak: int
    compute_s: float
    communication_s: float
    memory_traffic_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s + self.memory_traffic_s

    def row(self) -> dict[str, Any]:
        return {"layout": self.choice.describe(), "peak_bytes": self.peak, "step_s": self.step_s,
                "compute_s": self.compute_s, "communication_s": self.communication_s,
                "memory_traffic_s": self.memory_traffic_s, "turbo": self.turbo, "run": self.run}


@dataclass(frozen=True)
class Search:
    budget: int
    fitting: list[Candidate]  # fastest first
    tried: int
    refused: int  # candidates the planner refused (ConfigError)
    smallest: Candidate | None  # the smallest predicted peak of all, for a budget nothing fits

    @property
    def best(self) -> Candidate:
        if not self.fitting:
            least = "" if self.smallest is None else (
                f"; the smallest predicted peak is {self.smallest.peak / 2**20:,.1f} MiB "
                f"({self.smallest.choice.describe()})")
            raise ConfigError("--memory-per-rank", f"{self.budget / 2**20:,.1f}MiB",
                              "give more memory per rank, or more ranks",
                              reason=f"none of the {self.tried - self.refused} layouts fits{least}")
        return self.fitting[0]


def search(job: JobConfig, world: int, budget: int, hardware: Hardware = Hardware()) -> Search:
    """Every candidate layout of ``job`` at ``world`` ranks, planned; those under ``budget``."""
    model = build_model(job.model, job.peft)
    base = job.to_dict()
    tp_plan = _tp_plan(job, model)
    experts = _experts(model)
    rows = _rows_per_step(job, world)
    on_device = detect_device_type(job.turbo.device_type) != "cpu"
    defaults = type(job.turbo).from_dict({}).to_dict()
    candidates, refused = [], 0
    for choice in _choices(world, tp_plan is not None, experts, rows, on_device):
        turbo = _turbo(base["turbo"], choice, tp_plan, _chunk_size(job, choice))
        run = _run(base["run"], choice, rows)
        try:
            candidate_job = JobConfig.from_dict({**base, "turbo": turbo, "run": run})
            planned = plan_job(candidate_job, world, model=model)
        except ConfigError:  # a layout the library refuses for this model is not a candidate
            refused += 1
            continue
        candidates.append(_costed(choice, _changed(turbo, defaults), run, planned, candidate_job, model, hardware))
    fitting = sorted((c for c in candidates if c.peak <= budget), key=lambda c: (c.step_s, c.peak))
    smallest = min(candidates, key=lambda c: c.peak, default=None)
    return Search(budget, fitting, len(candidates) + refused, refused, smallest)


def _changed(section: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``section`` that differ from the defaults (nested sections likewise), as
    plain data: the section a job file would hold."""
    section = json.loads(json.dumps(section))
    defaults = json.loads(json.dumps(defaults))
    changed = {}
    for name, value in section.items():
        default = defaults.get(name)
        if isinstance(value, dict) and isinstance(default, dict):
            value = _changed(value, default)
            if value:
                changed[name] = value
        elif value != default or name.endswith("_size"):
            changed[name] = value
    return changed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(world: int, tp_allowed: bool, experts: int, rows: int, on_device: bool):
    for tp in _divisors(world) if tp_allowed else [1]:
        for cp in _divisors(world // tp):
            for dp in _divisors(world // (tp * cp)):
                fsdp = world // (tp * cp * dp)
                eps = [ep for ep in _divisors(world // tp) if experts and experts % ep == 0] or [1]
                per_shard = rows // (dp * fsdp)
                swaps = (False, True) if on_device else (False,)  # on CPU the host is the device
                for ep, recompute, chunk, swap, swap_activation, micro in itertools.product(
                        eps, (None, "selective", "full"), (False, True), swaps, swaps, _divisors(per_shard)):
                    yield Choice(dp, fsdp, cp, tp, ep, recompute, chunk, swap, swap_activation, micro,
                                 per_shard // micro)


def _rows_per_step(job: JobConfig, world: int) -> int:
    """The job's global batch: ``run.global_batch``, else its micro-batches at its own layout
    (or over every rank, where its sizes do not tile this world)."""
    if job.run.global_batch is not None:
        return job.run.global_batch
    try:
        return job_sizes(job, world).rows_per_step
    except ConfigError:
        return job.run.micro_batch * job.run.grad_accum * world


def _chunk_size(job: JobConfig, choice: Choice) -> int:
    """The job's chunk when it chunks its loss; else a quarter of a micro-batch's tokens
    (at most the default 1024), so the chunked loss does cut the logits."""
    if job.turbo.chunk_loss:
        return job.turbo.chunk_loss_plan.chunk_size
    return max(1, min(1024, choice.micro_batch * job.data.seq_len // (4 * choice.cp)))


def _turbo(section: dict[str, Any], choice: Choice, tp_plan: dict[str, Any] | None,
           chunk_size: int) -> dict[str, Any]:
    turbo = {**section, "data_parallel_size": choice.dp, "fully_shard_parallel_size": choice.fsdp,
             "context_parallel_size": choice.cp, "tensor_parallel_size": choice.tp,
             "expert_parallel_size": choice.ep, "recompute": choice.recompute is not None,
             "chunk_loss": choice.chunk_loss, "swap_optimizer": choice.swap_optimizer,
             "swap_activation": choice.swap_activation}
    if choice.recompute:
        turbo["recompute_policy"] = choice.recompute
    if choice.chunk_loss:
        turbo["chunk_loss_plan"] = {**(section.get("chunk_loss_plan") or {}), "chunk_size": chunk_size}
    if choice.tp > 1 and tp_plan is not None:
        turbo["tp_plan"] = tp_plan
    return turbo


def _run(section: dict[str, Any], choice: Choice, rows: int) -> dict[str, Any]:
    run = {**section, "micro_batch": choice.micro_batch}
    if section.get("global_batch") is None:
        run["grad_accum"] = choice.grad_accum
    return run


def _tp_plan(job: JobConfig, model: nn.Module) -> dict[str, Any] | None:
    """The job's own ``tp_plan``, else one made from the model config's ``base_model_tp_plan``
    (its ``colwise`` / ``rowwise`` Linears, and sequence parallel on the blocks' norms and
    the final norm); ``None`` when neither names a Linear."""
    own = job.turbo.tp_plan
    if own is not None and (own.colwise_parallel or own.rowwise_parallel):
        return job.to_dict()["turbo"]["tp_plan"]
    hf_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "model")
    styles: dict[str, list[str]] = {"colwise": [], "rowwise": []}
    for key, style in hf_plan.items():
        pattern = f"{prefix}.{key}"
        if style in styles and _linears(model, pattern):
            styles[style].append(pattern)
    if not styles["colwise"] or not styles["rowwise"]:
        return None
    return {"colwise_parallel": styles["colwise"], "rowwise_parallel": styles["rowwise"],
            "sequence_parallel": _norms(model, prefix)}


def _linears(model: nn.Module, pattern: str) -> bool:
    try:
        matched = match_modules(model, [pattern], field="tp_plan")
    except ConfigError:
        return False
    return all(isinstance(module, nn.Linear) for module in matched.values())


def _norms(model: nn.Module, prefix: str) -> list[str]:
    """The norms directly in the blocks (``*.input_layernorm``) and the base model's final one."""
    names: set[str] = set()
    for name, module in model.named_modules():
        parent = name.rsplit(".", 2)
        if "norm" in type(module).__name__.lower() and len(parent) == 3 and parent[1].isdigit():
            names.add(f"*.{parent[2]}")
    final = getattr(getattr(model, prefix, None), "norm", None)
    return sorted(names) + ([f"{prefix}.norm"] if isinstance(final, nn.Module) else [])


def _experts(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)
               or getattr(config, "n_routed_experts", 0) or 0)


def _costed(choice: Choice, turbo: dict[str, Any], run: dict[str, Any], planned: Planned, job: JobConfig,
            model: nn.Module, hardware: Hardware) -> Candidate:
    memory, model_memory = planned.memory, planned.model_memory
    layer = model_memory.layer
    world = planned.summary["world_size"]
    seq = job.data.seq_len
    global_tokens = job_sizes(job, world).rows_per_step * seq
    active, layer_params = _active_parameters(model)
    flops = (6 * active + 6 * model_memory.layers * seq * layer.q_dim) * global_tokens / world
    if choice.recompute == "full":
        flops += 2 * layer_params * global_tokens / world
    micro_batches = choice.grad_accum
    tokens = model_memory.tokens  # this rank's, per micro-batch (after CP)
    shards = choice.fsdp * choice.cp
    gradient_bytes = sum(layout.full_numel() * FP32 for layout in model_memory.params.values() if layout.trainable)
    received = memory.gathered + gradient_bytes * (shards - 1) / max(shards, 1)
    received += 2 * memory.gradients * (choice.dp - 1) / choice.dp
    received += 8 * model_memory.layers * tokens * layer.hidden * FP32 * (choice.tp - 1) / choice.tp
    received += 3 * 2 * layer.kv_dim * tokens * FP32 * (choice.cp - 1) * model_memory.layers
    received += 4 * tokens * layer.top_k * layer.hidden * FP32 * (choice.ep - 1) / choice.ep * model_memory.layers
    traffic = 0.0
    if choice.recompute == "selective":
        traffic += micro_batches * model_memory.layers * model_memory.rerun() / hardware.memory
    if choice.swap_optimizer:
        traffic += 2 * 2 * memory.gradients / hardware.host  # the two AdamW states, in and out
    if choice.swap_activation:
        traffic += micro_batches * 2 * model_memory.saved_layers() / hardware.host  # out in forward, back in backward
    return Candidate(choice, turbo, run, memory.peak, flops / hardware.flops,
                     micro_batches * received / hardware.link, traffic)


def _active_parameters(model: nn.Module) -> tuple[float, float]:
    """(parameters a token passes through, of them in the blocks): embeddings excluded, routed
    experts counted at ``top_k / experts``."""
    config = getattr(model, "config", None)
    experts = _experts(model)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    embedding = {id(p) for p in model.get_input_embeddings().parameters()} if hasattr(
        model, "get_input_embeddings") else set()
    active = in_layers = 0.0
    for name, param in model.named_parameters():
        if id(param) in embedding:
            continue
        share = top_k / experts if experts and top_k and ".experts." in f".{name}" else 1.0
        active += param.numel() * share
        if re.search(r"\.\d+\.", name):
            in_layers += param.numel() * share
    return active, in_layers


def auto_lines(result: Search, top: int = 5) -> list[str]:
    lines = [f"auto: {len(result.fitting)} of {result.tried - result.refused} layouts fit "
             f"{result.budget / 2**20:,.1f} MiB a rank ({result.refused} refused by the planner); fastest first:",
             "  step s    compute  comm     memory   peak MiB  layout"]
    for candidate in result.fitting[:top]:
        lines.append(f"  {candidate.step_s:8.4f}  {candidate.compute_s:7.4f}  {candidate.communication_s:7.4f}  "
                     f"{candidate.memory_traffic_s:7.4f}  {candidate.peak / 2**20:8.2f}  {candidate.choice.describe()}")
    return lines


def auto_json(result: Search, top: int = 5) -> dict[str, Any]:
    best = result.best
    return {"budget_bytes": result.budget, "tried": result.tried, "refused": result.refused,
            "fitting": len(result.fitting), "turbo": best.turbo, "run": best.run,
            "candidates": [candidate.row() for candidate in result.fitting[:top]]}


def with_best(job: JobConfig, result: Search) -> dict[str, Any]:
    """The job, as plain data, with the chosen layout's ``turbo`` and ``run`` sections."""
    best = result.best
    return json.loads(json.dumps({**job.to_dict(), "turbo": best.turbo, "run": best.run}))


def write_job(job: dict[str, Any], path: str | Path) -> None:
    """``job`` as a YAML job file ``train`` reads."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError("--write", str(path), "name a .yaml or .yml file")
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
