"""The loss of a model that returns logits (torchtitan's, a user's own), as one call the
training loop makes instead of ``F.cross_entropy``::

    loss = lm_loss(model, labels, tokens)   # runs model(tokens); labels[:, t] is the target of position t
    loss.backward()

HF causal LMs take ``labels`` in their own forward and need none of this. A model that
returns logits leaves the loss to the loop, and the loop cannot see what FSDPTurbo's
features changed: under context parallel each rank's logits cover its chunk of the
sequence, under loss parallel they are vocab-sharded, under chunked loss they are never
built. The features read and fill the pending :class:`LossRequest` while the model runs,
and register what the loss needs afterwards (:func:`set_logits_loss`,
:func:`add_loss_reducer`), so one call gives the same loss whatever is installed: the mean
over every label of the whole batch that is not the model facts' ``ignore_index``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import IGNORE_INDEX

LogitsLoss = Callable[..., torch.Tensor]  # (logits, labels, *, ignore_index, reduction) -> loss

_REQUEST = "_fsdp_turbo_loss_request"
_LOGITS_LOSS = "_fsdp_turbo_logits_loss"
_REDUCERS = "_fsdp_turbo_loss_reducers"


@dataclass
class LossRequest:
    """One ``lm_loss`` call, seen by the features while the model runs."""

    labels: torch.Tensor  # [B, S], aligned with the positions; context parallel cuts it to the rank's chunk
    ignore_index: int
    num_items: torch.Tensor  # the divisor: labels that count, over the whole batch (before any split)
    loss: torch.Tensor | None = None  # set by a head that computes the loss itself (chunked loss)


def pending_loss_request(model: nn.Module) -> LossRequest | None:
    """The request of the ``lm_loss`` call now running ``model``'s forward, if any."""
    return getattr(model, _REQUEST, None)


def set_logits_loss(model: nn.Module, loss: LogitsLoss) -> None:
    """Replace the cross-entropy ``lm_loss`` applies to ``model``'s logits (loss parallel:
    the vocab-sharded one)."""
    setattr(model, _LOGITS_LOSS, loss)


def add_loss_reducer(model: nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """After the loss is computed, ``reduce(loss)`` (context parallel: each rank's share of
    the sequence summed over the CP group)."""
    setattr(model, _REDUCERS, (*getattr(model, _REDUCERS, ()), reduce))


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
                   reduction: str) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1).to(flat.device), ignore_index=ignore_index, reduction=reduction)


def _logits(output: Any) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"lm_loss needs a model that returns logits (a tensor or .logits), not {type(output).__name__}")
    return logits


def _ignore_index(model: nn.Module, given: int | None) -> int:
    """The model facts' ``ignore_index`` (the default without FSDPTurbo). A different value
    given here is an error: the chunked loss and context parallel's padding use the facts'
    within the same step, and two values would count different labels."""
    facts = getattr(model, "fsdp_turbo_facts", None)
    known = facts.ignore_index if facts is not None else IGNORE_INDEX
    if given is not None and given != known and facts is not None:
        raise ConfigError("lm_loss(ignore_index=)", given, f"omit it, or set model_facts.ignore_index={given}",
                          reason=f"the model's facts say ignore_index={known}")
    return known if given is None else given


def lm_loss(model: nn.Module, labels: torch.Tensor, *args: Any, ignore_index: int | None = None,
            **kwargs: Any) -> torch.Tensor:
    """Run ``model(*args, **kwargs)`` and return the cross-entropy of its logits against
    ``labels`` ``[B, S]`` (already aligned: no shift is applied), averaged over the labels
    that are not ``ignore_index`` in the whole batch this rank was given. ``ignore_index``
    defaults to the model facts' (``model_facts.ignore_index``)."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be [batch, seq], not {tuple(labels.shape)}")
    ignore_index = _ignore_index(model, ignore_index)
    request = LossRequest(labels, ignore_index, (labels != ignore_index).sum().clamp_min(1))
    setattr(model, _REQUEST, request)
    try:
        output = model(*args, **kwargs)
    finally:
        delattr(model, _REQUEST)
    loss = request.loss
    if loss is None:
        logits_loss = getattr(model, _LOGITS_LOSS, _cross_entropy)
        total = logits_loss(_logits(output), request.labels, ignore_index=ignore_index, reduction="sum")
        loss = total / request.num_items.to(total.device)
    for reduce in getattr(model, _REDUCERS, ()):
        loss = reduce(loss)
    return loss


class _WithIgnoreIndex:
    """An HF ``loss_function`` that ignores the model facts' label, not its default -100."""

    def __init__(self, inner: Callable[..., torch.Tensor], ignore_index: int) -> None:
        self.inner, self.ignore_index = inner, ignore_index

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("ignore_index", self.ignore_index)
        return self.inner(*args, **kwargs)


def honour_ignore_index(model: nn.Module, ignore_index: int) -> None:
    """Make an HF model's own loss (``model.loss_function``) ignore ``ignore_index``. HF's
    losses default to -100; without this a ``model_facts.ignore_index`` of another value
    would hold for FSDPTurbo's losses and context parallel's padding but not for the model's
    own loss in the same step. Features that wrap the loss later (loss parallel, the
    chunked loss) wrap this one."""
    if ignore_index != IGNORE_INDEX and callable(getattr(model, "loss_function", None)):
        model.loss_function = _WithIgnoreIndex(model.loss_function, ignore_index)
