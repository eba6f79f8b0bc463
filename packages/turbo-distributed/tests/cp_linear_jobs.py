"""Rank functions for context parallel on linear-attention (Gated DeltaNet) models."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.core.testing import shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import replay_steps

# Packed rows of 16 tokens: even rows hold documents of 6 and 10 tokens, odd rows of 11 and
# 5, so at CP=2 (chunks of 8) and CP=4 (chunks of 4) a document starts inside a chunk.
DOCUMENTS = ((6, 10), (11, 5))


def _row_documents(row: int) -> tuple[int, ...]:
    return DOCUMENTS[row % 2]


def packed_positions(batch: torch.Tensor) -> torch.Tensor:
    """``position_ids`` restarting at each document (how transformers reads packed rows)."""
    return torch.stack([torch.cat([torch.arange(n) for n in _row_documents(row)]) for row in range(batch.shape[0])])


def packed_loss(model, batch):
    """One forward of the packed rows: a document's last token predicts nothing."""
    labels = batch.clone()
    for row in range(batch.shape[0]):
        first = _row_documents(row)[0]
        labels[row, first] = -100  # the first document's last token would predict it
    return model(input_ids=batch, labels=labels, position_ids=packed_positions(batch)).loss


def each_document_alone_loss(model, batch):
    """The reference of ``packed_loss``: every document in a forward of its own; the summed
    cross-entropy over the whole batch's count of labels."""
    total, count = 0.0, 0
    for parity in range(2):
        rows = batch[parity::2]
        start = 0
        for length in DOCUMENTS[parity]:
            document = rows[:, start:start + length]
            logits = model(input_ids=document).logits[:, :-1]
            total = total + F.cross_entropy(logits.flatten(0, 1), document[:, 1:].flatten(), reduction="sum")
            count += document[:, 1:].numel()
            start += length
    return total / count


def plain_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


LOSSES = {"plain": plain_loss, "packed": packed_loss, "alone": each_document_alone_loss}


def replay_cases(cases, batches, params_file):
    """The one-process reference of each case ``(name, kind, config, loss)``, replayed from the
    weights the case had before each step (``replay_steps``; ``params_file``: ``torch.save`` of
    ``{name: record.params}``, too many tensors to hand a new process); a packed case's
    reference runs each document alone."""
    params = torch.load(params_file, weights_only=True)  # data, never code
    return {name: replay_steps(tiny_hf_causal_lm(kind), batches, params[name],
                               loss_fn=LOSSES["alone" if loss == "packed" else loss])
            for name, kind, _, loss in cases}


def cp_cases(cases, batches, record_params=False):
    """Each case ``(name, kind, config, loss)`` trained under FSDPTurbo on this rank's rows:
    ``{name: (record, how many linear-attention layers run CP's forward)}``; with
    ``record_params`` the record holds every step's weights and gradients (``replay_steps``)."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for name, kind, config, loss in cases:
        model = FSDPTurbo(config, tiny_hf_causal_lm(kind))
        state = model.parallel_state
        wrapped = sum(isinstance(m.forward, functools.partial) for n, m in model.named_modules()
                      if n.endswith("linear_attn"))
        local = [shard_rows(b, state.dp_rank, state.dp_size) for b in batches]
        results[name] = (train_steps(model, local, loss_fn=LOSSES[loss], record_params=record_params), wrapped)
    return results
