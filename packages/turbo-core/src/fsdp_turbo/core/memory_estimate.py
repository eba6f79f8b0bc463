"""A per-rank memory estimate built from the features' plans (``fsdp-turbo plan``).

It starts from the whole model on one rank. Each enabled feature's plan then refines it
(``FeaturePlan.estimate``), in pipeline order. TP and EP shrink the parameters they
split. FSDP shards what is left over ``fsdp x cp``, padding the shard dim as FSDP2 pads
it. CP divides the tokens. Recompute, activation swap, the chunked loss and loss
parallel change which activations stay, and the optimizer swap moves the states to the
host.

Model state: fp32 parameters and the trainable ones' gradients; AdamW keeps two fp32 states per trainable
parameter and a 4-byte step per tensor. MX training keeps fp32 master weights, so it does
not change the model state; QLoRA-MX stores frozen weights in ``1 + 1/block`` bytes per
element (``ParamLayout.bytes_per_element``, set by the quantization plan).

Activations per micro-batch are a formula, not a measurement. Per decoder layer,
``tokens x (16 H + 3 I)`` values are kept for backward, where ``I`` is the active MLP
width. With full recompute a layer keeps ``tokens x H`` (``x 8 H`` selective), plus one
layer's worth while it re-runs. With activation swap, about two blocks' worth stays on
the device. Add the fp32 logits and their gradient, or one chunk of them with the
chunked loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from fsdp_turbo.core.model_facts import ModelFacts

FP32 = 4


@dataclass
class ParamLayout:
    """One parameter as this rank holds it."""

    shape: list[int]  # after the TP / EP splits
    shards: int = 1  # FSDP shards of ``shard_dim`` (padded to a multiple, as FSDP2 does)
    shard_dim: int = 0
    trainable: bool = True  # frozen (e.g. a LoRA model's base): no gradient, no optimizer state
    bytes_per_element: float = FP32  # as stored (QLoRA-MX's packed frozen weights: 1 + 1/block)
    # what one FSDP all-gather moves per element: param_dtype's size, or MX bytes
    # (quantization_plan.low_precision_all_gather: 1 + 1/block per orientation)
    gather_bytes_per_element: float | None = None
    gathers: int = 2  # FSDP all-gathers a step: forward and again in backward (1 where it keeps them)

    def numel(self) -> int:
        if not self.shape:
            return 1
        shape = list(self.shape)
        shape[self.shard_dim] = math.ceil(shape[self.shard_dim] / self.shards)
        return math.prod(shape)


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    frozen: int = 0  # of ``parameters``, the bytes of frozen ones
    gathered: int = 0  # bytes this rank receives in FSDP all-gathers per step (forward and backward)

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer


@dataclass
class MemoryModel:
    """What the estimate is computed from; the plans' ``estimate`` methods change it."""

    params: dict[str, ParamLayout]
    tokens: int  # per micro-batch on this rank
    hidden: int
    inter: int  # the active MLP width
    layers: int
    vocab: int
    per_layer: int  # values per token each layer keeps for backward
    rerun: int = 0  # values per token of the one layer recompute re-runs at a time
    swapped: bool = False  # activation swap: about two blocks' worth stays on the device
    logit_chunk: int | None = None  # the chunked loss builds this many rows of logits at a time
    vocab_shards: int = 1  # loss parallel keeps the logits vocab-sharded
    optimizer_on_device: bool = True

    @classmethod
    def of(cls, model: nn.Module, tokens: int, facts: ModelFacts) -> MemoryModel:
        """The whole ``model`` on one rank, for micro-batches of ``tokens`` tokens."""
        sizes = facts.sizes
        moe = sizes.top_k and sizes.moe_intermediate
        inter = sizes.top_k * sizes.moe_intermediate if moe else sizes.intermediate
        params = {name: ParamLayout(list(param.shape), trainable=param.requires_grad)
                  for name, param in model.named_parameters()}
        return cls(params, tokens, sizes.hidden, inter, sizes.layers, sizes.vocab,
                   per_layer=16 * sizes.hidden + 3 * inter)

    def totals(self) -> MemoryEstimate:
        parameters = math.ceil(sum(layout.numel() * layout.bytes_per_element for layout in self.params.values()))
        trainable = [layout for layout in self.params.values() if layout.trainable]
        gradients = sum(layout.numel() for layout in trainable) * FP32
        optimizer = 2 * gradients + FP32 * len(trainable) if self.optimizer_on_device else 0
        kept = self.layers * self.tokens * self.per_layer + self.tokens * self.rerun
        if self.swapped:
            kept = min(kept, 2 * kept // max(self.layers, 1))
        logit_rows = min(self.tokens, self.logit_chunk) if self.logit_chunk else self.tokens
        activations = (kept + 2 * logit_rows * self.vocab // self.vocab_shards) * FP32
        frozen = math.ceil(sum(layout.numel() * layout.bytes_per_element for layout in self.params.values()
                               if not layout.trainable))
        return MemoryEstimate(parameters, gradients, optimizer, activations, frozen, self.gathered_per_step())

    def gathered_per_step(self) -> int:
        """Bytes one rank receives from FSDP's all-gathers in a step: every sharded parameter's
        other shards, in what its gather moves, once per gather (``ParamLayout.gathers``)."""
        return math.ceil(sum(layout.gathers * layout.numel() * (layout.shards - 1) * layout.gather_bytes_per_element
                             for layout in self.params.values()
                             if layout.shards > 1 and layout.gather_bytes_per_element))
