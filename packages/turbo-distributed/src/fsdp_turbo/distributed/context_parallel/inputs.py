"""The training loop stays unchanged: the model's forward pre-hook turns the full-length
batch each CP rank receives into that rank's sequence chunk.

1. ``labels`` are shifted here (``shift_labels``), so no chunk needs its neighbour's token;
2. the sequence is padded to a multiple of cp (label ``model_facts.ignore_index``, so padding is not in the loss;
   it sits at the end, so causal attention keeps real tokens from seeing it);
3. input ids (or embeddings), shifted labels and absolute ``position_ids`` are cut to the
   rank's chunk; a 2-D padding ``attention_mask`` is kept whole for the attention wrapper,
   and so are packed documents: where ``position_ids`` restart inside a row (as transformers
   reads packed sequences), the wrapper masks attention to each document;
4. ``num_items_in_batch`` is the number of valid labels of the whole sequence, so each rank's
   loss is its share of the full-sequence mean (summed over CP in ``loss``).

Models that are not HF's name their arguments (``model_facts.token_input`` / ``position_input``:
torchtitan's ``tokens`` / ``positions``); positional calls are read by the forward's
signature. A model that returns logits has its loss computed by ``core.lm_loss``, whose
pending labels are cut here like the tokens.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.lm_loss import LossRequest, pending_loss_request
from fsdp_turbo.core.model_facts import IGNORE_INDEX
from fsdp_turbo.core.stage_part import stage_role
from fsdp_turbo.distributed.context_parallel.context import CPState, ForwardContext
from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions


def padded_length(seq_len: int, cp: int, multiple: int | None = None) -> int:
    multiple = cp if multiple is None else multiple
    return -(-seq_len // multiple) * multiple


def ring_positions(state: CPState, full: int) -> list[torch.Tensor]:
    """Each ring member's token positions in the padded sequence: contiguous chunks, or
    zig-zag pairs with load balancing (pure Ulysses: one member, the whole sequence)."""
    load_balance = state.mode != "ulysses" and state.load_balance
    return [chunk_positions(full, state.ring_size, member, load_balance) for member in range(state.ring_size)]


def local_positions(state: CPState, members: list[torch.Tensor], rank: int | None = None) -> torch.Tensor:
    """This rank's (or CP rank ``rank``'s) positions: its Ulysses rank's contiguous part of its
    ring member's (CP rank = ring rank x ulysses_size + Ulysses rank)."""
    rank = state.rank if rank is None else rank
    mine = members[rank // state.ulysses_size]
    part = mine.numel() // state.ulysses_size
    ulysses_rank = rank % state.ulysses_size
    return mine[ulysses_rank * part:(ulysses_rank + 1) * part]


def sequence_order(state: CPState, members: list[torch.Tensor]) -> torch.Tensor | None:
    """Where each position sits in the CP ranks' tokens gathered in rank order, or None where
    that order is the sequence's (contiguous chunks in rank order)."""
    gathered = torch.cat([local_positions(state, members, rank) for rank in range(state.size)])
    if torch.equal(gathered, torch.arange(gathered.numel())):
        return None
    return torch.argsort(gathered)


def _pad(x: torch.Tensor, extra: int, value: float | int) -> torch.Tensor:
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, extra]  # dim 1 is the sequence
    return F.pad(x, pad, value=value)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Position ``t`` predicts token ``t + 1``; the last position predicts nothing."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


@dataclass(frozen=True)
class InputNames:
    """What context parallel reads of a forward call, from the model facts: the arguments it
    splits and gives positions by name (``model_facts.token_input`` / ``position_input``:
    HF's by default, torchtitan's ``tokens`` / ``positions``), and the label its padding gets."""

    tokens: str = "input_ids"
    positions: str = "position_ids"
    ignore_index: int = IGNORE_INDEX


def _sequence(kwargs: dict[str, Any], names: InputNames) -> torch.Tensor:
    tokens = kwargs.get(names.tokens)
    if tokens is None and names.tokens == "input_ids":
        tokens = kwargs.get("inputs_embeds")
    if tokens is None or tokens.dim() < 2:
        field = "input_ids" if names.tokens == "input_ids" else "model_facts.token_input"
        raise ConfigError(field, names.tokens, f"call the model with {names.tokens}=[batch, seq] (or set "
                          "model_facts.token_input to the argument that holds the tokens)",
                          reason="context parallel splits the sequence of that argument")
    return tokens


def split_inputs(state: CPState, kwargs: dict[str, Any], names: InputNames = InputNames(),
                 request: LossRequest | None = None, *, cut: bool = False) -> dict[str, Any]:
    """The rank's chunk of a full-length forward call (keyword arguments); records the
    forward's context. ``request``: an ``lm_loss`` call's, whose labels are cut the same way.
    ``cut``: the hidden states are already this rank's chunk (a later pipeline stage's, handed
    on by the stage before); the call's full-length positions give the sequence."""
    cp = state.size
    tokens = _sequence(kwargs, names)
    batch, seq_len = tokens.shape[:2]
    if cut:
        seq_len = kwargs[names.positions].shape[1]
    full = padded_length(seq_len, cp, 2 * cp if state.mode != "ulysses" and state.load_balance else cp)
    extra = full - seq_len
    members = ring_positions(state, full)
    local = local_positions(state, members).to(tokens.device)
    out = dict(kwargs)
    for name in {names.tokens, "inputs_embeds"} if names.tokens == "input_ids" else {names.tokens}:
        if kwargs.get(name) is not None and not cut:
            out[name] = _pad(kwargs[name], extra, 0)[:, local]
    positions = kwargs.get(names.positions)
    if positions is None:
        positions = torch.arange(seq_len, device=tokens.device).expand(batch, seq_len)
    # Padding continues the positions, so RoPE stays defined there.
    tail = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)
    whole_positions = torch.cat([positions, tail], dim=1) if extra else positions
    out[names.positions] = whole_positions[:, local]
    labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
    if labels is not None or shifted is not None:
        shifted = shift_labels(labels, names.ignore_index) if shifted is None else shifted
        shifted = _pad(shifted, extra, names.ignore_index)
        if kwargs.get("num_items_in_batch") is None:
            out["num_items_in_batch"] = (shifted != names.ignore_index).sum().clamp_min(1)  # all ignored: 0, not NaN
        out["shift_labels"] = shifted[:, local].contiguous()
        out["labels"] = out["shift_labels"]  # HF computes a loss only when labels are given
    if request is not None:  # already aligned; its divisor counts the whole sequence's labels
        request.labels = _pad(request.labels, extra, request.ignore_index)[:, local.to(request.labels.device)]
    mask = kwargs.get("attention_mask")
    padding = None
    if mask is not None:
        if mask.dim() != 2:
            raise ConfigError("attention_mask", tuple(mask.shape), "pass a 2-D padding mask [batch, seq]",
                              reason="context parallel builds the full-sequence causal mask itself")
        padding = _pad(mask.bool(), extra, False)
        padding = None if bool(padding[:, :seq_len].all()) else padding
        out["attention_mask"] = None  # the wrapper builds the full-sequence mask itself
    state.current = ForwardContext(full, padding, packed_documents(kwargs.get(names.positions), extra),
                                   ring_positions=members if state.mode != "ulysses" else None,
                                   positions=whole_positions, my_positions=local,
                                   sequence_order=sequence_order(state, members))
    return out


def packed_documents(positions: torch.Tensor | None, extra: int) -> torch.Tensor | None:
    """Each token's document index ``[B, seq + extra]`` where ``position_ids`` restart
    inside a row (a new document wherever a position is not its predecessor's plus one,
    transformers' rule), else ``None``. The CP padding joins the last document."""
    if positions is None or positions.shape[1] < 2:
        return None
    starts = torch.diff(positions, dim=1) != 1
    if not bool(starts.any()):
        return None
    documents = F.pad(starts.long().cumsum(1), (1, 0))
    return F.pad(documents, (0, extra), mode="replicate") if extra else documents


def _refuse_attention_weights(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    asked = kwargs.get("output_attentions")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_attentions", False)
    if asked:
        raise ConfigError("output_attentions", True, "call the model without output_attentions under context "
                          "parallel (or with context_parallel_size=1)",
                          reason="each rank would return attention weights of its head shard only")


def _refuse_past_key_values(kwargs: dict[str, Any]) -> None:
    past = kwargs.get("past_key_values")
    if past is not None:
        raise ConfigError("past_key_values", type(past).__name__, "call the model without past_key_values under "
                          "context parallel (or with context_parallel_size=1)",
                          reason="a cache continues one whole sequence, and each CP rank holds a chunk of it")


def _prove_the_wrapper_ran(state: CPState) -> None:
    # A model that imported its attention function by name (``from x import f``) keeps the
    # original when CP replaces ``x.f``: its attention would then see only the local chunk.
    calls = state.current.attention_calls if state.current is not None else 0
    if calls < state.attention_layers:
        raise ConfigError("model_facts.attention_function", "not wrapped",
                          "point model_facts.attention_function at the name the model calls (the module that "
                          "imported it, e.g. 'my_model.layers.attention'), or use an HF attn_implementation",
                          reason=f"the Ulysses wrapper ran in {calls} of {state.attention_layers} attention layers, "
                                 "so attention would cover only this rank's chunk")
    linear = state.current.linear_calls if state.current is not None else 0
    if linear < state.linear_layers:
        raise ConfigError("context_parallel_size", state.size, "use context_parallel_size=1 for this model",
                          reason=f"the linear-attention forward ran in {linear} of {state.linear_layers} layers "
                                 "(something replaced it), so they would cover only this rank's chunk")
    state.proven = True


def _by_name(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name (``model(tokens)`` -> ``{"tokens": tokens}``)."""
    bound = signature.bind_partial(*args, **kwargs).arguments
    named: dict[str, Any] = {}
    for name, value in bound.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ConfigError("input_ids", "positional", "call the model with keyword arguments",
                                  reason="context parallel reads its inputs by name, and these have none")
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def install_input_splitter(model: torch.nn.Module, state: CPState, names: InputNames = InputNames()):
    """Register the root's forward pre-hook (split the inputs) and, until the first forward
    has shown that every attention layer ran through the wrapper, a forward hook that checks."""
    signature = inspect.signature(model.forward)

    def hook(module, args, kwargs):
        kwargs = _by_name(signature, args, kwargs)
        _refuse_attention_weights(module, kwargs)
        _refuse_past_key_values(kwargs)
        role = stage_role(module)  # a pipeline stage after the first gets this rank's chunk
        return (), split_inputs(state, kwargs, names, pending_loss_request(module),
                                cut=role is not None and not role.first)

    def check(module, args, output):
        if not state.proven:
            _prove_the_wrapper_ran(state)
        return output

    model.register_forward_hook(check)
    return model.register_forward_pre_hook(hook, with_kwargs=True)
