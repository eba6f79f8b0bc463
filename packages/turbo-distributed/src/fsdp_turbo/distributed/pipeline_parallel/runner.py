"""``model.fsdp_turbo_pipeline``: one training step through the pipeline schedule."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.distributed.pipeline_parallel.plan import PipelinePlan
from fsdp_turbo.distributed.pipeline_parallel.schedules import SCHEDULES
from fsdp_turbo.distributed.pipeline_parallel.stages import StageSpec


class PipelineRunner:
    """Runs ``step(input_ids, labels)``: the batch split into the plan's micro-batches, each
    through every stage, forward and backward, as the schedule orders them.

    The loss of each micro-batch is its summed cross-entropy over the whole batch's target
    tokens (and gradients are not rescaled), so the step's loss and gradients are the
    whole batch's mean, however the tokens fall into micro-batches: the same as one forward
    of the batch. Every rank of the pipeline gets the loss back."""

    def __init__(self, parts: list[tuple[StageSpec, nn.Module]], plan: PipelinePlan, state: ParallelState) -> None:
        self.plan = plan
        self.parts = [module for _, module in parts]
        self._group = state.mesh("pp").get_group()
        device = torch.device(state.device_type) if state.device_type == "cpu" else torch.device(
            state.device_type, torch.get_device_module(state.device_type).current_device())
        self.stages = [PipelineStage(module, spec.index, len(plan.stages), device, group=self._group)
                       for spec, module in parts]
        kind = SCHEDULES[plan.schedule]
        schedule = get_schedule_class(kind.torch_name)
        self.schedule = schedule(self.stages if kind.multi else self.stages[0], n_microbatches=plan.microbatches,
                                 loss_fn=self._loss, scale_grads=False)
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self._last_rank = dist.get_global_rank(self._group, plan.stages[-1].rank)
        self._targets = torch.ones(())

    def parameters(self):
        """Every parameter this rank trains, over all its stages (give these to the optimizer)."""
        seen = set()
        for part in self.parts:
            for param in part.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch (``[rows, seq]`` each, the same on every rank of
        this pipeline); returns the batch's mean loss on every rank. Gradients accumulate in
        the parameters, as ``loss.backward()`` would leave them."""
        rows = input_ids.shape[0]
        if rows % self.plan.microbatches:
            raise ConfigError("pipeline_microbatches", self.plan.microbatches,
                              f"use a divisor of the batch's {rows} rows, or feed a multiple of it",
                              reason="every micro-batch holds the same number of rows")
        self._targets = (labels[:, 1:] != self.plan.ignore_index).sum().clamp(min=1)
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        extra = {"target": labels, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **extra)
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=input_ids.device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = logits[:, :-1].float()
        return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=self.plan.ignore_index, reduction="sum") / self._targets
