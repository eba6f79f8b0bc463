"""Where each checkpoint tensor lives inside the model's tensors.

A Hugging Face checkpoint stores what transformers' ``save_pretrained`` writes: tied weights
once, and some tensors in another form than the model holds them. Fused MoE experts
(``experts.gate_up_proj [E, 2I, H]``) are stored as one ``gate_proj`` and one ``up_proj``
per expert, for example. transformers' own save conversion says how
(``core.hf.SaveConversions``). Here each of its steps is followed as a box: a
checkpoint tensor is the box ``start:start+size`` of one model tensor, with some model
dims dropped. A rank that holds a box of the model tensor then reads only the checkpoint
slices that overlap it.

The steps followed are transformers' ``Chunk`` (equal pieces along a dim) and
``SplitModulelist`` (one entry per index along a dim, that dim dropped). These are what
every MoE family in transformers uses. Any other step is a ``CheckpointError`` that names
it, never a silent full read. The names and shapes derived here are checked against
transformers' own conversion run on the meta-device model, so a mapping that
transformers changes cannot drift unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_turbo.core import hf
from fsdp_turbo.core.errors import CheckpointError


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor: the box ``start:start + size`` of a model tensor, whose
    dims ``kept`` (in order) are the checkpoint tensor's dims; the others have size 1."""

    key: str
    start: tuple[int, ...]
    size: tuple[int, ...]
    kept: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size[d] for d in self.kept)


@dataclass(frozen=True)
class Layout:
    """Every saved model tensor's checkpoint pieces, in the model's order (a tied weight's
    second name is not saved: it shares the first one's tensor)."""

    pieces: dict[str, tuple[Piece, ...]]  # model key -> its checkpoint tensors

    @property
    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return {p.key: p.shape for pieces in self.pieces.values() for p in pieces}


def _whole(key: str, shape: tuple[int, ...]) -> Piece:
    return Piece(key, (0,) * len(shape), tuple(shape), tuple(range(len(shape))))


def _chunk(box: Piece, dim: int, count: int) -> list[Piece]:
    # torch.chunk: pieces of ceil(n / count), the last one shorter (none past the end).
    model_dim = box.kept[dim]
    length = box.size[model_dim]
    step = -(-length // count)
    out = []
    for first in range(0, length, step):
        start, size = list(box.start), list(box.size)
        start[model_dim] += first
        size[model_dim] = min(step, length - first)
        out.append(Piece(box.key, tuple(start), tuple(size), box.kept))
    return out


def _split_entries(box: Piece, dim: int) -> list[Piece]:
    model_dim = box.kept[dim]
    kept = tuple(d for d in box.kept if d != model_dim)
    out = []
    for index in range(box.size[model_dim]):
        start, size = list(box.start), list(box.size)
        start[model_dim] += index
        size[model_dim] = 1
        out.append(Piece(box.key, tuple(start), tuple(size), kept))
    return out


def _converted_pieces(conversions: hf.SaveConversions, key: str, shape: tuple[int, ...],
                      conversion: hf.SaveConversion) -> list[Piece]:
    """Follow transformers' save steps for ``key``, naming each result as transformers does."""
    # name pattern -> box; a step maps each entry to its results, as the ops map their dicts
    entries: dict[str, Piece] = {conversion.layer_name: _whole(key, shape)}
    for op in conversion.operations:
        kind = type(op).__name__
        if kind == "Chunk" and len(entries) == 1 and not op.num_shards_attribute:
            (box,) = entries.values()
            parts = _chunk(box, op.dim, len(conversion.target_patterns))
            entries = dict(zip(conversion.target_patterns, parts, strict=True))
        elif kind == "SplitModulelist":
            entries = {pattern.replace("*", str(i), 1): part for pattern, box in entries.items()
                       for i, part in enumerate(_split_entries(box, op.dim))}
        else:
            raise CheckpointError(key, kind, "load this model with transformers' from_pretrained on one rank, "
                                  "or ask for this conversion to be supported",
                                  reason=f"its checkpoint conversion step {kind} cannot be read in slices yet")
    # The results are named like the model key: the part matching a result replaced by it.
    full = conversion.layer_name.replace("*.", "0.")
    anchor = next((name for name in entries if name in full), None)
    if anchor is None:
        raise CheckpointError(key, conversion.layer_name, "report this model type",
                              reason="its checkpoint names cannot be derived")
    prefix, _, suffix = full.partition(anchor)
    return [Piece(conversions.name(prefix + name + suffix), box.start, box.size, box.kept)
            for name, box in entries.items()]


def checkpoint_layout(blueprint: nn.Module) -> Layout:
    """The layout of ``blueprint``'s checkpoints (a meta-device model in its original form)."""
    saved = hf.saved_state(blueprint, blueprint.state_dict(keep_vars=True))
    conversions = hf.SaveConversions(blueprint)
    pieces: dict[str, tuple[Piece, ...]] = {}
    for key, tensor in saved.items():
        conversion = conversions.for_key(key)
        shape = tuple(tensor.shape)
        found = (_converted_pieces(conversions, key, shape, conversion) if conversion is not None
                 else [_whole(conversions.name(key), shape)])
        pieces[key] = tuple(found)
    layout = Layout(pieces)
    _check_against_transformers(blueprint, saved, layout)
    return layout


def _check_against_transformers(blueprint: nn.Module, saved: dict[str, torch.Tensor], layout: Layout) -> None:
    expected = {k: tuple(t.shape) for k, t in hf.to_checkpoint_layout(blueprint, saved).items()}
    derived = layout.checkpoint_shapes
    if derived != expected:
        differ = sorted(set(derived.items()) ^ set(expected.items()))[:6]
        raise CheckpointError("checkpoint layout", type(blueprint).__name__, "report this model type",
                              reason=f"the derived checkpoint names/shapes differ from transformers' ({differ})")
