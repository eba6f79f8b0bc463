"""A per-rank memory estimate of one training step, built from the features' plans
(``fsdp-turbo plan``), and checked against measured peaks (``tests: test_integ_memory_model``).

It starts from the whole model on one rank. Each enabled feature's plan then refines it
(``FeaturePlan.estimate``), in pipeline order. TP and EP shrink the parameters they split
(and TP the layers' widths). FSDP shards what is left over ``fsdp x cp`` (padded as FSDP2
pads), and names each parameter's unit. CP divides the tokens. Recompute, chunk_batch,
activation swap, the chunked loss and loss parallel change what stays, and the optimizer
swap moves the states to the host.

**Model state.** fp32 parameters and the trainable ones' gradients; AdamW keeps two fp32
states per trainable parameter and a 4-byte step per tensor. MX training keeps fp32 master
weights; QLoRA-MX stores frozen weights in ``1 + 1/block`` bytes per element.

**Saved activations** (``LayerShape``) are counted from what each op of a decoder layer
keeps for its backward, read off the autograd graph of the Hugging Face layers: an RMSNorm
keeps its input, the normalized values and the weighted output (3 H); attention keeps q, k,
v as it reads them, its output and the softmax statistics; a SwiGLU MLP its gate, up,
activation and product (4 I); a routed MoE layer, per routed row, the dispatched input, the
expert's gate/up, activation and product and its output (2 H + 4 I), plus the combined
output and the router's scores. Selective recompute keeps the layer input and every matmul
and attention output; full recompute the input alone, and one layer's worth while it re-runs.

**The peak** is the largest of the moments a step passes through (``phases``):
- ``loss``: the backward's start. All saved activations, the root unit's gathered
  parameters (kept from forward), the next units' prefetched gathers (the backward prefetch
  depth: FSDP2's implicit one, or ``fsdp_plan.num_to_backward_prefetch``), and the loss: the
  log-softmax the cross-entropy keeps plus the two logits-sized gradients of its backward
  (three logits' worth). The chunked loss runs in forward instead: one chunk of logits,
  the head's weight gradient and the hidden states' gradient;
- ``layer backward``: the last layer's backward, with every activation still saved, its
  unit and the prefetched ones gathered, the head's gradient, a recomputed layer's re-run,
  and the backward's own temporaries (about three of the layer's widest intermediates);
- ``layer reduce-scatter``: a unit's unsharded gradients copied into FSDP's reduce-scatter
  buffer;
- ``root reduce-scatter``: the end of backward: the root unit's gradients reduce-scattered
  while every other unit's sharded gradients exist;
- ``optimizer``: parameters, gradients, states and the step's temporaries.

What the device's collectives and optimizer add depends on the backend: gloo's
reduce-scatter copies its input once more, and AdamW on CPU runs tensor by tensor (two
temporaries of the largest) where CUDA's foreach step holds one more copy of the
gradients. ``MemoryModel.device_type`` picks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from fsdp_turbo.core.model_facts import ModelFacts

FP32 = 4
ROOT_UNIT = ""  # the FSDP unit of the parameters outside every other unit


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
    unit: str | None = None  # its FSDP unit (ROOT_UNIT: the root's); None: not sharded by FSDP
    unsharded_bytes_per_element: float = FP32  # the gathered parameter (param_dtype)

    def numel(self) -> int:
        if not self.shape:
            return 1
        shape = list(self.shape)
        shape[self.shard_dim] = math.ceil(shape[self.shard_dim] / self.shards)
        return math.prod(shape)

    def full_numel(self) -> int:
        """Elements once gathered (this rank's TP / EP part, whole over FSDP)."""
        return math.prod(self.shape) if self.shape else 1


@dataclass
class LayerShape:
    """One decoder layer as this rank computes it; counts values per token."""

    hidden: int
    q_dim: int  # query heads x head_dim
    kv_dim: int  # key/value heads x head_dim (each of k and v)
    heads: int
    kv_heads: int
    inter: int = 0  # dense (or shared-expert) SwiGLU width
    top_k: int = 0  # routed experts per token (0: a dense layer)
    moe_inter: int = 0
    experts: int = 0
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    tp: int = 1  # tensor parallel splits heads and MLP widths
    sequence_parallel: bool = False  # the norms see 1/tp of the tokens

    def _split(self, values: float) -> float:
        return values / self.tp

    def _norm(self) -> float:
        """An RMSNorm keeps its input, the normalized values (and 1/rms), and hands the weighted
        output to the projections, which keep it; under SP the first two are sequence-sharded
        and the projections keep the all-gathered output."""
        sharded = 2 * self.hidden + 1
        return sharded / self.tp + self.hidden if self.sequence_parallel else sharded + self.hidden

    def _attention(self) -> float:
        qk_norm = 2 * self.q_dim + self.heads + 2 * self.kv_dim + self.kv_heads if self.qk_norm else 0
        # q, k, v as attention reads them, its output (o_proj's input) and a statistic a head
        return self._split(2 * self.q_dim + 2 * self.kv_dim + self.heads + qk_norm)

    def _routed_tokens(self) -> float:
        """The share of the tokens the routed experts see: under SP, each rank routes its
        sequence shard (the experts are split by EP, not TP)."""
        return 1 / self.tp if self.sequence_parallel else 1

    def _mlp(self) -> float:
        dense = 4 * self.inter  # gate, up, act(gate), act(gate) * up
        routed = self.top_k * (2 * self.hidden + 4 * self.moe_inter) + 2 * self.hidden + 2 * self.experts
        return self._split(dense) + (routed * self._routed_tokens() if self.top_k else 0)

    def saved(self) -> float:
        """Kept for backward by a layer without recompute."""
        return 2 * self._norm() + self._attention() + self._mlp()

    def kept_input(self) -> float:
        """What a fully recomputed layer keeps: its input."""
        return self.hidden / self.tp if self.sequence_parallel else self.hidden

    def matmul_outputs(self) -> float:
        """What selective recompute keeps: the input, every matmul's and attention's output."""
        projections = self._split(self.q_dim + 2 * self.kv_dim + 2 * self.inter) + self.hidden * (
            2 / self.tp if self.sequence_parallel else 2)
        attention = self._split(self.q_dim + self.heads)
        routed = (self.top_k * (self.hidden + 3 * self.moe_inter) + self.experts) * self._routed_tokens() \
            if self.top_k else 0
        return self.kept_input() + projections + attention + routed

    def widest(self) -> float:
        """The widest per-token intermediate: what a backward's temporaries scale with."""
        return max(self._split(max(self.inter, self.q_dim)), self.top_k * self.moe_inter * self._routed_tokens(),
                   self.hidden)

    def final_norm(self) -> float:
        return self._norm()


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward, per micro-batch (the layers and around them)
    frozen: int = 0  # of ``parameters``, the bytes of frozen ones
    gathered: int = 0  # bytes this rank receives in FSDP all-gathers per step (forward and backward)
    transients: dict[str, int] = field(default_factory=dict)  # the peak moments' transient terms
    phases: dict[str, int] = field(default_factory=dict)  # bytes at each moment of the step

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak(self) -> int:
        """The step's peak bytes on this rank: its largest moment."""
        return max(self.phases.values()) if self.phases else self.model_state + self.activations

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__) if self.phases else "model state + activations"


@dataclass
class MemoryModel:
    """What the estimate is computed from; the plans' ``estimate`` methods change it."""

    params: dict[str, ParamLayout]
    tokens: int  # per micro-batch on this rank
    layer: LayerShape
    layers: int
    vocab: int
    head_dim: int = 0
    recompute: str | None = None  # 'full' or 'selective' (a custom op list counts as selective)
    rerun_slices: int = 1  # chunk_batch: a recomputed layer re-runs one batch slice at a time
    swapped: bool = False  # activation swap: about two blocks' worth stays on the device
    logit_chunk: int | None = None  # the chunked loss builds this many rows of logits at a time
    vocab_shards: int = 1  # loss parallel keeps the logits vocab-sharded
    optimizer_on_device: bool = True
    backward_prefetch: int = 1  # FSDP units gathered ahead in backward (FSDP2's implicit one)
    device_type: str = "cpu"
    pp_rank: int = 0  # pipeline parallel: the pp coordinate whose stages are estimated
    in_flight: int = 1  # pipeline parallel: micro-batches whose activations a rank keeps at once

    @classmethod
    def of(cls, model: nn.Module, tokens: int, facts: ModelFacts, *, device_type: str = "cpu") -> MemoryModel:
        """The whole ``model`` on one rank, for micro-batches of ``tokens`` tokens."""
        sizes = facts.sizes
        heads = sizes.heads or 1
        kv_heads = sizes.kv_heads or heads
        moe = bool(sizes.top_k and sizes.moe_intermediate)
        shared = _shared_expert_width(model) if moe else 0
        layer = LayerShape(sizes.hidden, heads * sizes.head_dim, kv_heads * sizes.head_dim, heads, kv_heads,
                           inter=shared if moe else sizes.intermediate, top_k=sizes.top_k if moe else 0,
                           moe_inter=sizes.moe_intermediate if moe else 0, experts=sizes.experts if moe else 0,
                           qk_norm=_has_qk_norm(model))
        params = {name: ParamLayout(list(param.shape), trainable=param.requires_grad)
                  for name, param in model.named_parameters()}
        return cls(params, tokens, layer, sizes.layers, sizes.vocab, head_dim=sizes.head_dim)

    # -- the terms ------------------------------------------------------------------------

    def _per_layer_kept(self) -> float:
        if self.recompute == "full":
            return self.layer.kept_input()
        if self.recompute == "selective":
            return self.layer.matmul_outputs()
        return self.layer.saved()

    def saved_layers(self) -> int:
        kept = self.layers * self.tokens * self._per_layer_kept() * self.in_flight
        if self.swapped:
            kept = min(kept, 2 * kept / max(self.layers, 1))
        return math.ceil(kept * FP32)

    def _saved_one_layer(self) -> float:
        return self.saved_layers() / max(self.layers, 1)

    def saved_outside(self) -> int:
        """Kept outside the layers: the rotary tables and the final norm."""
        return math.ceil(self.tokens * (2 * self.head_dim + self.layer.final_norm()) * FP32)

    def logits(self) -> int:
        rows = min(self.tokens, self.logit_chunk) if self.logit_chunk else self.tokens
        return rows * math.ceil(self.vocab / self.vocab_shards) * FP32  # vocab 0: a stage without the head

    def rerun(self) -> int:
        """What a recomputed layer makes again in its backward: its activations, less what the
        policy kept."""
        if self.recompute is None:
            return 0
        return math.ceil(self.tokens * (self.layer.saved() - self._per_layer_kept()) * FP32 / self.rerun_slices)

    def backward_temporaries(self) -> int:
        return math.ceil(3 * self.tokens * self.layer.widest() * FP32)

    def _unit_bytes(self, grads: bool = False) -> dict[str, float]:
        units: dict[str, float] = {}
        for layout in self.params.values():
            if layout.unit is None or (grads and not layout.trainable):
                continue
            size = FP32 if grads else layout.unsharded_bytes_per_element
            units[layout.unit] = units.get(layout.unit, 0) + layout.full_numel() * size
        return units

    def _layer_units(self, grads: bool = False) -> list[float]:
        """Each non-root unit with the units nested in it (prefetching a layer gathers its experts)."""
        units = {name: size for name, size in self._unit_bytes(grads).items() if name != ROOT_UNIT}
        outer = [name for name in units if not any(name.startswith(o + ".") for o in units if o != name)]
        return [sum(size for inner, size in units.items() if inner == name or inner.startswith(name + "."))
                for name in outer]

    def _root_late_grads(self) -> int:
        """The root's gradients made before the layers' backward: of the parameters after the
        last layer (the final norm and the head), which FSDP keeps unsharded until the end."""
        order = list(self.params.items())
        last_layer = max((i for i, (_, layout) in enumerate(order) if layout.unit not in (None, ROOT_UNIT)),
                         default=-1)
        return sum(layout.full_numel() * FP32 for _, layout in order[last_layer + 1:]
                   if layout.unit == ROOT_UNIT and layout.trainable)

    def _root_first_grad(self) -> int:
        """The root's first parameter's gradient (the embedding's): made last, autograd still
        holds it while FSDP reduce-scatters the root."""
        first = next((layout for layout in self.params.values() if layout.unit == ROOT_UNIT), None)
        return first.full_numel() * FP32 if first is not None and first.trainable else 0

    def _shards(self) -> int:
        return max((layout.shards for layout in self.params.values() if layout.unit is not None), default=1)

    def _reduce_scatter(self, grads: float) -> float:
        """A unit's reduce-scatter: its gradients copied into the input buffer, then the output
        shard (and gloo's copy of the input)."""
        copy = grads if self.device_type == "cpu" else 0
        return max(2 * grads, grads + grads / self._shards() + copy)

    def _optimizer_temporaries(self, gradients: int) -> int:
        trainable = [layout.numel() * FP32 for layout in self.params.values() if layout.trainable]
        if not self.optimizer_on_device or not trainable:
            return 0
        # CPU AdamW steps tensor by tensor; CUDA's foreach step holds a list the size of the grads
        return 2 * max(trainable) if self.device_type == "cpu" else gradients

    # -- the estimate ---------------------------------------------------------------------

    def totals(self) -> MemoryEstimate:
        parameters = math.ceil(sum(layout.numel() * layout.bytes_per_element for layout in self.params.values()))
        trainable = [layout for layout in self.params.values() if layout.trainable]
        gradients = sum(layout.numel() for layout in trainable) * FP32
        optimizer = 2 * gradients + FP32 * len(trainable) if self.optimizer_on_device else 0
        saved = self.saved_layers()
        outside = self.saved_outside()
        frozen = math.ceil(sum(layout.numel() * layout.bytes_per_element for layout in self.params.values()
                               if not layout.trainable))
        units = self._unit_bytes()
        root = units.get(ROOT_UNIT, 0)
        layer_units = self._layer_units() or [0]
        unit, unit_grads = max(layer_units), max(self._layer_units(grads=True) or [0])
        prefetched = unit * min(self.backward_prefetch, max(self.layers - 1, 0))  # up to the prefetch depth
        logits = self.logits()
        late = self._root_late_grads()
        root_grads = self._unit_bytes(grads=True).get(ROOT_UNIT, 0)
        layer_grads_sharded = gradients - sum(layout.numel() * FP32 for layout in trainable
                                              if layout.unit == ROOT_UNIT)
        if self.logit_chunk and self.logit_chunk < self.tokens:
            # the chunked loss makes the head's and the hidden states' gradients in forward, one
            # chunk of logits at a time (its gradient made in place); backward starts without them
            loss = late + max(logits + self.tokens * self.layer.hidden * FP32, prefetched)
        else:  # the log-softmax the cross-entropy keeps, then its two logits-sized gradients
            loss = 3 * logits + prefetched
        transients = {
            "gathered_root_unit": math.ceil(root),
            "gathered_layer_unit": math.ceil(unit),
            "prefetched_units": math.ceil(prefetched),
            "loss": math.ceil(loss),
            "head_gradient": math.ceil(late),
            "recompute_rerun": self.rerun(),
            "backward_temporaries": self.backward_temporaries(),
            "layer_reduce_scatter": math.ceil(self._reduce_scatter(unit_grads)),
            "root_reduce_scatter": math.ceil(self._reduce_scatter(root_grads) + self._root_first_grad()),
            "optimizer_temporaries": self._optimizer_temporaries(gradients),
        }
        state = parameters + optimizer
        held = state + root + saved + outside
        phases = {
            "loss": held + loss,
            "layer backward": held + late + unit + prefetched + self.rerun() + self.backward_temporaries(),
            "layer reduce-scatter": held - self._saved_one_layer() + late + prefetched
            + self._reduce_scatter(unit_grads),
            "root reduce-scatter": state + layer_grads_sharded + transients["root_reduce_scatter"],
            "optimizer": state + gradients + transients["optimizer_temporaries"],
        }
        return MemoryEstimate(parameters, gradients, optimizer, saved + outside, frozen, self.gathered_per_step(),
                              transients, {name: math.ceil(value) for name, value in phases.items()})

    def gathered_per_step(self) -> int:
        """Bytes one rank receives from FSDP's all-gathers in a step: every sharded parameter's
        other shards, in what its gather moves, once per gather (``ParamLayout.gathers``)."""
        return math.ceil(sum(layout.gathers * layout.numel() * (layout.shards - 1) * layout.gather_bytes_per_element
                             for layout in self.params.values()
                             if layout.shards > 1 and layout.gather_bytes_per_element))


def _has_qk_norm(model: nn.Module) -> bool:
    return any(name.endswith((".q_norm", ".k_norm")) for name, _ in model.named_modules())


def _shared_expert_width(model: nn.Module) -> int:
    """A shared expert's SwiGLU width (Qwen2-MoE, DeepSeek), from its first gate projection."""
    for name, module in model.named_modules():
        if name.endswith(("shared_expert", "shared_experts")):
            gate = getattr(module, "gate_proj", None)
            if isinstance(gate, nn.Linear):
                return gate.out_features
    return 0
