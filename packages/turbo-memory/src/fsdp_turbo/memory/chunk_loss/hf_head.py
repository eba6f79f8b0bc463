"""Chunked loss inside an HF causal-LM's own forward: ``model(input_ids=..., labels=...)``
returns the same loss, and the [tokens, vocab] logits are never built.

The root's pre-hook records the labels; the head (called once, as a module, so FSDP's
all-gather and reduce-scatter fire once per step) computes the chunked loss instead of
logits; the model's ``loss_function`` hands that loss back; ``output.logits`` is None.

A model that returns logits (not HF's) has no labels to record: its loop asks for the loss
with ``core.lm_loss(model, labels, ...)``, the head answers that call's pending request, and
the model returns an empty ``[..., 0]`` stand-in for the logits it did not build.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.lm_loss import pending_loss_request
from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.model_facts import IGNORE_INDEX, ModelFacts, plain_api_facts
from fsdp_turbo.memory.chunk_loss.function import chunked_cross_entropy
from fsdp_turbo.memory.chunk_loss.vocab_shard import empty_logits, local_head, local_hidden

HANDLE_ATTR = "_fsdp_turbo_chunk_loss"
_log = get_logger(__name__)


@dataclass(frozen=True)
class ChunkLossSettings:
    chunk_size: int = 1024
    ignore_index: int = IGNORE_INDEX
    z_loss_weight: float = 0.0
    logit_softcap: float | None = None
    hf: bool = True  # an HF causal LM (labels in forward); else the loss comes through core.lm_loss
    backward_twice: bool = False  # beside a zero-bubble pipeline, whose weight pass re-runs the backward


@dataclass
class _Request:
    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None
    num_items: Any


def resolve_head(model: nn.Module, facts: ModelFacts) -> tuple[str, nn.Module]:
    """The model facts' output head, which must be Linear-like. Raises ConfigError."""
    field = "model_facts.head_module"
    if facts.head is None:
        raise ConfigError(field, None, "set model_facts.head_module='lm_head' (your output head)",
                          reason="the model has no output embedding to default to")
    head = model.get_submodule(facts.head)
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ConfigError(field, facts.head, "point it at a Linear-like head",
                          reason=f"the head ({type(head).__name__}) has no 2-D [vocab, hidden] weight")
    return facts.head, head


def is_hf_causal_lm(model: nn.Module) -> bool:
    """HF causal LMs take ``labels`` and compute their loss in forward; other models return
    logits, and their loop asks for the loss with ``core.lm_loss``."""
    return "labels" in inspect.signature(model.forward).parameters and hasattr(model, "loss_function")


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    # HF's ForCausalLMLoss: position t predicts token t+1; the last position predicts nothing.
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


class _HeadClassCache:
    classes: dict[type, type] = {}

    @classmethod
    def chunking(cls, base: type) -> type:
        if base not in cls.classes:
            def forward(self, hidden, *args, **kwargs):
                handle = getattr(self, HANDLE_ATTR)
                request = handle.take_request()
                if request is None:
                    return base.forward(self, hidden, *args, **kwargs)
                return handle.loss_instead_of_logits(self, hidden, request)

            cls.classes[base] = type(f"ChunkedLoss{base.__name__}", (base,), {"forward": forward})
        return cls.classes[base]


class _LossPassthrough:
    """The model's ``loss_function``: returns the chunked loss when the head computed one."""

    def __init__(self, inner: Any, handle: ChunkedLossHandle) -> None:
        self.inner, self.handle = inner, handle

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.handle.take_loss()
        return self.inner(*args, **kwargs) if loss is None else loss


class ChunkedLossHandle:
    """Chunked loss installed on an HF causal LM; ``remove()`` restores the model."""

    def __init__(self, model: nn.Module, head: nn.Module, settings: ChunkLossSettings) -> None:
        self.model, self.head, self.settings = model, head, settings
        self._signature = inspect.signature(model.forward)
        self._request: _Request | None = None
        self._loss: torch.Tensor | None = None
        self._produced = False
        self._base_class = type(head)
        self._hf = settings.hf
        self._pending = None  # the lm_loss request the head is answering
        setattr(head, HANDLE_ATTR, self)
        head.__class__ = _HeadClassCache.chunking(type(head))
        self._hooks = [model.register_forward_hook(self._finish, always_call=True)]
        if self._hf:
            self._inner_loss = model.loss_function
            model.loss_function = _LossPassthrough(self._inner_loss, self)
            self._hooks.append(model.register_forward_pre_hook(self._record_labels, with_kwargs=True))

    # ----- root hooks --------------------------------------------------------------------
    def _record_labels(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = self._signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
        labels, shift_labels = bound.get("labels"), extra.get("shift_labels")
        self._request = None if labels is None and shift_labels is None else _Request(
            labels, shift_labels, extra.get("num_items_in_batch"))
        self._loss = None
        self._produced = False

    def _finish(self, module: nn.Module, args: tuple, output: Any) -> Any:
        produced = self._produced
        self._request, self._loss, self._produced = None, None, False
        logits = getattr(output, "logits", None)
        if produced and logits is not None and logits.shape[-1] == 0:
            output.logits = None  # the empty stand-in, not logits anyone could use
        return output

    # ----- head --------------------------------------------------------------------------
    def take_request(self) -> _Request | None:
        if self._hf:
            request, self._request = self._request, None
            return request
        pending = pending_loss_request(self.model)
        if pending is None or pending.loss is not None:
            self._warn_full_logits()
            return None
        self._pending = pending
        return _Request(None, pending.labels, pending.num_items)

    def _warn_full_logits(self) -> None:
        warn_once(_log, f"chunk_loss: {type(self.model).__name__} returned its full logits: the chunked loss runs "
                  "only when the loop asks for the loss with fsdp_turbo.fsdp_turbo.lm_loss(model, labels, ...)")

    def take_loss(self) -> torch.Tensor | None:
        loss, self._loss = self._loss, None
        return loss

    def loss_instead_of_logits(self, head: nn.Module, hidden: torch.Tensor, request: _Request) -> torch.Tensor:
        settings = self.settings
        local = local_head(head.weight, getattr(head, "bias", None))
        hidden_local = local_hidden(hidden, local)
        labels = request.shift_labels
        if labels is None:
            labels = _shifted(request.labels, settings.ignore_index)
        self._loss = chunked_cross_entropy(
            hidden_local, local.weight, labels.to(hidden_local.device), bias=local.bias,
            chunk_size=settings.chunk_size, ignore_index=settings.ignore_index,
            num_items=request.num_items, z_loss_weight=settings.z_loss_weight,
            logit_softcap=settings.logit_softcap, vocab_group=local.vocab_group, vocab_start=local.vocab_start,
            backward_twice=settings.backward_twice)
        self._produced = True
        if not self._hf:  # lm_loss takes it from its request
            self._pending.loss, self._pending, self._loss = self._loss, None, None
        return empty_logits(hidden, hidden_local)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.head.__class__ = self._base_class
        delattr(self.head, HANDLE_ATTR)
        if self._hf:
            self.model.loss_function = self._inner_loss


def plan_chunked_loss(model: nn.Module, facts: ModelFacts, *, chunk_size: int = 1024, z_loss_weight: float = 0.0,
                      logit_softcap: float | None = None) -> tuple[str, ChunkLossSettings]:
    """The head's name and the settings ``install_chunked_loss`` would use. Raises ConfigError.

    The head and the ignored label are the model facts'. ``logit_softcap`` defaults to the
    model's ``final_logit_softcapping`` (Gemma), which the model would otherwise apply to
    the logits it no longer builds.
    """
    name, head = resolve_head(model, facts)
    ignore_index = facts.ignore_index
    if hasattr(head, HANDLE_ATTR):
        raise ConfigError("chunk_loss", True, "install chunked loss once", reason="the head already has it")
    if logit_softcap is None:
        logit_softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return name, ChunkLossSettings(chunk_size, ignore_index, z_loss_weight, logit_softcap, is_hf_causal_lm(model))


def install_chunked_loss(model: nn.Module, facts: ModelFacts | None = None, **options: Any) -> ChunkedLossHandle:
    """Make ``model(..., labels=...)`` compute its loss chunk by chunk (HF causal LMs), or,
    for a model that returns logits, ``core.lm_loss(model, labels, ...)``. Without the
    facade, ``facts`` default to what the model says of itself (give
    ``resolve_model_facts(model, ModelFactsConfig(head_module=...))`` for other models);
    ``options`` are :func:`plan_chunked_loss`'s."""
    head, settings = plan_chunked_loss(model, facts if facts is not None else plain_api_facts(model), **options)
    return ChunkedLossHandle(model, model.get_submodule(head), settings)
