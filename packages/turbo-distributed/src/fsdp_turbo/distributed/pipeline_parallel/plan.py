"""The pipeline plan: which layers each stage holds, which stages this rank runs, the
schedule and its micro-batches; every check made on every rank before anything is sent."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.patterns import is_peft_model
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow
from fsdp_turbo.distributed.pipeline_parallel.schedules import SCHEDULES, check_microbatches, stages_per_rank
from fsdp_turbo.distributed.pipeline_parallel.stages import StageSpec, plan_stages
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel


@dataclass(frozen=True)
class PipelinePlan(FeaturePlan):
    pp: int
    schedule: str
    microbatches: int
    stages: tuple[StageSpec, ...]
    layers: str  # the module list holding the decoder layers
    embedding: str  # on the first stage
    last: tuple[str, ...]  # the modules after the layers (final norm, head): on the last stage
    model_facts: ModelFacts  # the whole model's (each stage's part has its own, of what it holds)

    def local_stages(self, pp_rank: int) -> tuple[StageSpec, ...]:
        """This rank's stages, in stage order."""
        return tuple(stage for stage in self.stages if stage.rank == pp_rank)

    def modules_of(self, stage: StageSpec) -> tuple[str, ...]:
        first = (self.embedding,) if stage.index == 0 else ()
        last = self.last if stage.index == len(self.stages) - 1 else ()
        return (*first, *(f"{self.layers}.{i}" for i in stage.layers()), *last)

    def in_flight(self, stage: StageSpec) -> int:
        """Micro-batches whose activations ``stage`` keeps at once: every one under GPipe; under
        the 1F1B family, one for each stage from it to the end of the pipeline (at most all)."""
        if self.schedule == "gpipe":
            return self.microbatches
        return min(self.microbatches, len(self.stages) - stage.index)

    def estimate(self, memory: MemoryModel) -> None:
        # One pp rank's stages: their parameters, layers and micro-batches in flight (the
        # largest of its stages'); the logits only where the head is.
        local = self.local_stages(memory.pp_rank)
        held = tuple(name for stage in local for name in self.modules_of(stage))
        memory.params = {name: layout for name, layout in memory.params.items()
                         if any(name == m or name.startswith(m + ".") for m in held)}
        memory.layers = sum(len(stage.layers()) for stage in local)
        memory.tokens //= self.microbatches
        memory.in_flight = max(self.in_flight(stage) for stage in local)
        if not any(stage.index == len(self.stages) - 1 for stage in local):
            memory.vocab = 0

    def describe(self) -> tuple[PlanRow, ...]:
        return tuple(PlanRow(f"pipeline stage {stage.index} (pp rank {stage.rank}, {self.schedule}, "
                             f"{self.microbatches} micro-batches)", self.modules_of(stage)) for stage in self.stages)


def _check_composable(config: FSDPTurboConfig, model: nn.Module) -> None:
    if is_peft_model(model):
        raise ConfigError("pipeline_parallel_size", config.pipeline_parallel_size,
                          "set it to 1 for a PEFT model, or train the full model",
                          reason="splitting a PEFT model into stages is not verified against one process yet")
    if config.router_bias_update_rate > 0:
        raise ConfigError("router_bias_update_rate", config.router_bias_update_rate,
                          "set it to 0, or pipeline_parallel_size to 1",
                          reason="the routers' biases move at every forward, from the load all-reduced over every "
                                 "rank: a pipeline would move them once per micro-batch, beside ranks that hold "
                                 "other layers")


def _layer_list(model: nn.Module, facts: ModelFacts) -> str:
    parents = {block.rpartition(".")[0] for block in facts.blocks}
    if not facts.blocks or len(parents) != 1 or not isinstance(model.get_submodule(parents.pop()), nn.ModuleList):
        raise ConfigError("model_facts.blocks", list(facts.blocks), "name decoder layers that sit in one "
                          "nn.ModuleList, e.g. ['model.layers.*']",
                          reason="pipeline stages split one list of layers")
    return facts.blocks[0].rpartition(".")[0]


def _outside(model: nn.Module, layers: str) -> list[str]:
    """The modules holding parameters outside the layers, outermost first."""
    inside = (layers, layers + ".")
    names = [name for name, module in model.named_modules()
             if name and not name.startswith(inside) and next(module.parameters(recurse=False), None) is not None]
    return [name for name in names if not any(name.startswith(other + ".") for other in names if other != name)]


def _check_ends(model: nn.Module, facts: ModelFacts, outside: list[str]) -> tuple[str, tuple[str, ...]]:
    if facts.embedding is None or facts.head is None:
        raise ConfigError("model_facts.embedding_module", facts.embedding, "name the token embedding and the head "
                          "(model_facts.embedding_module, model_facts.head_module)",
                          reason="the first stage holds the embedding, the last the head")
    if model.get_submodule(facts.embedding).weight is getattr(model.get_submodule(facts.head), "weight", None):
        raise ConfigError("model.config.tie_word_embeddings", True, "untie the embedding and the head for a pipeline",
                          reason="the first stage holds the embedding and the last the head: one tensor cannot "
                                 "live on both")
    if "inputs_embeds" not in inspect.signature(type(model).forward).parameters:
        raise ConfigError("pipeline_parallel_size", None, "use a model whose forward takes inputs_embeds",
                          reason=f"{type(model).__name__} cannot start a later stage from hidden states")
    before = [name for name in outside if name != facts.embedding and name in facts.before_blocks]
    if before:
        raise ConfigError("pipeline_parallel_size", None, "turn pipeline parallel off for this model",
                          reason=f"{before} run before the layers beside the embedding; a stage split would "
                                 "leave them on the first stage only")
    return facts.embedding, tuple(name for name in outside if name != facts.embedding)


def plan_pipeline(config: FSDPTurboConfig, model: nn.Module, pp: int, facts: ModelFacts) -> PipelinePlan:
    _check_composable(config, model)
    kind = SCHEDULES[config.pipeline_schedule]
    per_rank = stages_per_rank(config.pipeline_schedule, config.pipeline_stages_per_rank)
    layers = _layer_list(model, facts)
    stages = plan_stages(len(facts.blocks), pp, per_rank, kind.style, config.pipeline_split_points)
    microbatches = config.pipeline_microbatches or len(stages)
    check_microbatches(config.pipeline_schedule, microbatches, len(stages), pp)
    embedding, last = _check_ends(model, facts, _outside(model, layers))
    return PipelinePlan(pp, config.pipeline_schedule, microbatches, stages, layers, embedding, last,
                        facts)
