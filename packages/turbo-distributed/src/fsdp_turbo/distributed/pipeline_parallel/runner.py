"""``model.fsdp_turbo_pipeline``: one training step through the pipeline schedule."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.stage_part import metadata_inference
from fsdp_turbo.distributed.pipeline_parallel.plan import PipelinePlan
from fsdp_turbo.distributed.pipeline_parallel.schedules import SCHEDULES
from fsdp_turbo.distributed.pipeline_parallel.stages import StageSpec


class _Stage(PipelineStage):
    """torch's stage, its shape-learning passes marked (:func:`metadata_inference`). torch
    >= 2.12 learns the shapes the stages exchange from a real forward and backward of one
    micro-batch, at the first step and whenever a step follows an evaluation."""

    def _prepare_forward_infra(self, *args, **kwargs):
        with metadata_inference():
            return super()._prepare_forward_infra(*args, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        with metadata_inference():
            return super()._prepare_backward_infra(*args, **kwargs)


def _as_loss(loss: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    return loss  # the last stage's forward already returns the model's own loss


class PipelineRunner:
    """Runs ``step(input_ids, labels, ...)``: the batch split into the plan's micro-batches,
    each through every stage, forward and backward, as the schedule orders them.

    Each micro-batch's loss is the model's own (HF's ``loss_function``, with every feature
    that changes it), over the whole batch's loss tokens (``num_items_in_batch``), and
    gradients are not rescaled: the step's loss and gradients are the whole batch's mean,
    however the tokens fall into micro-batches, as one forward of the batch gives them.
    Every rank of the pipeline gets the loss back."""

    def __init__(self, parts: list[tuple[StageSpec, nn.Module]], plan: PipelinePlan, state: ParallelState) -> None:
        self.plan = plan
        self.parts = [module for _, module in parts]
        self._group = state.mesh("pp").get_group()
        device = torch.device(state.device_type) if state.device_type == "cpu" else torch.device(
            state.device_type, torch.get_device_module(state.device_type).current_device())
        self.stages = [_Stage(module, spec.index, len(plan.stages), device, group=self._group)
                       for spec, module in parts]
        kind = SCHEDULES[plan.schedule]
        schedule = get_schedule_class(kind.torch_name)
        self.schedule = schedule(self.stages if kind.multi else self.stages[0], n_microbatches=plan.microbatches,
                                 loss_fn=_as_loss, scale_grads=False)
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self._last_rank = dist.get_global_rank(self._group, plan.stages[-1].rank)

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter this rank trains, over all its stages (give these to the optimizer)."""
        seen = set()
        for part in self.parts:
            for param in part.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by the whole model's names (stages keep them)."""
        for part in self.parts:
            yield from part.named_parameters()

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, *, position_ids: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None,
             num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        """Forward and backward of one batch (``[rows, seq]`` each, the same on every rank of
        this pipeline; ``labels`` as the model takes them, unshifted); returns the batch's
        loss on every rank. ``num_items_in_batch`` is the loss's divisor (default: the
        batch's loss tokens; a data-parallel loop passes its global count over the data
        shards, as to the model's own forward). Gradients accumulate in the parameters, as
        ``loss.backward()`` would leave them."""
        return self._run(self.schedule.step, input_ids, labels, position_ids, attention_mask, num_items_in_batch)

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 num_items_in_batch: torch.Tensor | float | None = None) -> torch.Tensor:
        """The batch's loss, forward only (as ``step``, without gradients)."""
        return self._run(self.schedule.eval, input_ids, labels, position_ids, attention_mask, num_items_in_batch)

    def _run(self, run, input_ids, labels, position_ids, attention_mask, num_items_in_batch) -> torch.Tensor:
        rows = input_ids.shape[0]
        if rows % self.plan.microbatches:
            raise ConfigError("pipeline_microbatches", self.plan.microbatches,
                              f"use a divisor of the batch's {rows} rows, or feed a multiple of it",
                              reason="every micro-batch holds the same number of rows")
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != self.plan.model_facts.ignore_index).sum().clamp(min=1)
        if position_ids is None:  # every stage needs them: a later one cannot count its tokens' places
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        # a number, not a tensor: the schedule hands it whole to every micro-batch's call
        inputs = {"labels": labels, "position_ids": position_ids, "num_items_in_batch": float(num_items_in_batch)}
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first else ()
        extra = {"target": labels, "losses": losses} if self.has_last else {}
        run(*args, **inputs, **extra)
        loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros((), device=input_ids.device)
        dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss
