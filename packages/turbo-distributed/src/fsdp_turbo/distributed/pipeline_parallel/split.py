"""A stage's module: the user's model with the other stages' layers taken out and the
first/last stage's ends (embedding; final norm and head) replaced by stand-ins
(:class:`~fsdp_turbo.core.stage_part.HeldElsewhere`, an identity).

Parameter names stay the full model's (the kept layers keep their indices as names), so a
stage's ``state_dict`` keys are the model's own and checkpoints line up across PP sizes.
Its forward runs the model's own forward, with the call's other inputs (labels, positions,
padding mask), each cut to the micro-batch by the schedule:

- the first stage from the tokens (``input_ids``), the others from the hidden states
  (``inputs_embeds``), named so, so the features' forward hooks read them as in one process
  (context parallel cuts the first stage's tokens and knows a later stage's are cut);
- a stage that is not last returns the hidden states where the logits would be (its norm
  and head are stand-ins);
- the last returns the model's own loss (shape ``[1]``), from the labels and the whole
  batch's ``num_items_in_batch``, so the features that change the loss (loss parallel, the
  chunked loss, context parallel's sum) change it here too."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.stage_part import HeldElsewhere, StageRole, mark_stage_part
from fsdp_turbo.distributed.pipeline_parallel.plan import PipelinePlan
from fsdp_turbo.distributed.pipeline_parallel.stages import StageSpec


def stage_module(model: nn.Module, plan: PipelinePlan, stage: StageSpec, *, reuse: bool) -> nn.Module:
    """Stage ``stage`` of ``model``: ``model`` itself, cut down, when ``reuse`` (this rank's
    first stage), else a copy (further stages of an interleaved or V schedule)."""
    part = model if reuse else copy.deepcopy(model)
    every = part.get_submodule(plan.layers)
    kept = nn.ModuleList()
    for index in stage.layers():
        kept.add_module(str(index), every[index])  # the layer keeps its index as its name
    part.set_submodule(plan.layers, kept)
    role = StageRole(first=stage.index == 0, last=stage.index == len(plan.stages) - 1)
    for name in (() if role.first else (plan.embedding,)) + (() if role.last else plan.last):
        part.set_submodule(name, HeldElsewhere())
    mark_stage_part(part, role)
    # an instance attribute, so FSDP's and the other features' hooks still run around it
    part.forward = StageForward(part.forward, role)
    return part


class StageForward:
    """A stage's ``forward(activations, labels=None, **kwargs)``, named as the model's own
    forward names them, for the hooks that read the call by its signature."""

    def __init__(self, forward, role: StageRole) -> None:
        self.forward, self.role = forward, role
        self.__signature__ = _signature("input_ids" if role.first else "inputs_embeds")

    def __call__(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if self.role.last:
            out = self.forward(input_ids=input_ids, inputs_embeds=inputs_embeds, labels=labels, use_cache=False,
                               **kwargs)
            # shaped [1]: the schedule concatenates the last stage's outputs over micro-batches
            return torch.stack([out.loss])
        for loss_only in ("shift_labels", "num_items_in_batch"):  # read by the last stage's loss
            kwargs.pop(loss_only, None)
        out = self.forward(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False, **kwargs).logits
        # a stand-in head hands back a slice of the hidden states: a view, which the zero-bubble
        # schedules' split backward cannot detach, so the stage's output owns its storage
        return out.clone() if out._is_view() else out


def _signature(activations: str) -> inspect.Signature:
    kind = inspect.Parameter
    return inspect.Signature([kind(activations, kind.POSITIONAL_OR_KEYWORD, default=None),
                              kind("labels", kind.KEYWORD_ONLY, default=None),
                              kind("kwargs", kind.VAR_KEYWORD)])
