"""The Trainer's loss for a model that returns logits (torchtitan's, a user's own): ``core.lm_loss``.

transformers' ``Trainer`` expects the model to take ``labels`` and return its loss. A model that
returns logits leaves the loss to the loop, and under FSDPTurbo the loop cannot see what the
features changed (each CP rank's logits cover its chunk, loss-parallel logits are
vocabulary-sharded, the chunked loss never builds them): ``lm_loss`` is the one call that gives the
same loss in every case. The labels are the Trainer's (the inputs, as transformers' causal LMs
take them: position ``t + 1`` is the target of position ``t``), shifted here.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.lm_loss import lm_loss

__all__ = ["computes_its_loss", "logits_model_loss"]


def computes_its_loss(model: nn.Module) -> bool:
    """Whether the model's forward takes ``labels`` (or any keyword), so computes its own loss."""
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def logits_model_loss(model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any,
                      data_shards: int) -> torch.Tensor:
    """The step's loss on this rank as ``Trainer.compute_loss`` makes a model's own: the global token mean when
    the Trainer counted the step's tokens (``num_items_in_batch``), scaled by the data shards FSDP averages over;
    else this batch's mean."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    ignore_index = model.fsdp_turbo_facts.ignore_index
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index)  # lm_loss takes aligned targets
    loss = lm_loss(model, targets, **inputs)  # this rank's batch mean (under CP: summed over the group)
    if num_items_in_batch is None:
        return loss
    counted = (targets != ignore_index).sum()
    return loss * counted / num_items_in_batch * data_shards
