"""A stage's module: the user's model with the other stages' layers taken out and the
first/last stage's ends (embedding; final norm and head) replaced by ``nn.Identity``.

Parameter names stay the full model's (the kept layers keep their indices as names), so a
stage's ``state_dict`` keys are the model's own and checkpoints line up across PP sizes.
Its forward runs the model's own forward: the first stage from the tokens, the others from
the hidden states (``inputs_embeds``); a stage that is not last returns the hidden states
where the logits would be (its norm and head are identities)."""

from __future__ import annotations

import copy
import functools

from torch import nn

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
    last = stage.index == len(plan.stages) - 1
    for name in (() if stage.index == 0 else (plan.embedding,)) + (() if last else plan.last):
        part.set_submodule(name, nn.Identity())
    # the model's own forward, from tokens or from hidden states; an instance attribute, so
    # FSDP's and the other features' hooks still run around it
    part.forward = functools.partial(_stage_forward, part.forward, stage.index == 0)
    return part


def _stage_forward(forward, first: bool, inputs):
    source = {"input_ids": inputs} if first else {"inputs_embeds": inputs}
    out = forward(**source, use_cache=False).logits
    # an identity head hands back a slice of the hidden states: a view, which the zero-bubble
    # schedules' split backward cannot detach, so the stage's output owns its storage
    return out.clone() if out._is_view() else out
