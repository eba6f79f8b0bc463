"""Batches for the training loop, and the loader's resumable state.

A window becomes one row of four tensors:
- ``input_ids``: its pieces back to back, then padding;
- ``labels``: the pieces' tokens (SFT: the ignore index outside assistant turns), with the
  first token of every piece at the ignore index, so no position predicts across a
  boundary; padding is the ignore index. That is the job's ``turbo.model_facts.ignore_index``
  (default ``core.model_facts.IGNORE_INDEX``, -100), the value the losses leave out;
- ``position_ids``: restarting at 0 in every piece and in the padding. transformers reads
  packed sequences from exactly this and masks attention per document (and our context
  parallel wrapper does the same on the whole sequence);
- ``attention_mask``: only without packing (one piece per row, padding masked out).

Training takes the stream of ``mixture.Mixture``: a step's global batch is its next
``micro_batch x dp_size`` windows, data shard ``dp_rank`` the ``micro_batch`` at
``dp_rank``. The state is the number of windows consumed, so a resume continues the same
stream, at any data-parallel size, and takes every window exactly once. It also holds the
seed and each source's data identity (see ``prepare``): a resume on other data is refused,
one on a copy of the same data (another node, another folder) is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_turbo.cli.data.mixture import Mixture
from fsdp_turbo.cli.data.prepare import PreparedSource
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_facts import IGNORE_INDEX

_log = get_logger(__name__)
IGNORE = IGNORE_INDEX  # the default; a job's own is turbo.model_facts.ignore_index


@dataclass
class Batch:
    input_ids: torch.Tensor  # [micro_batch, seq_len]
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # without packing only
    ignore_index: int = IGNORE_INDEX  # the label value that carries no loss

    def to(self, device: torch.device) -> Batch:
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return Batch(self.input_ids.to(device), self.labels.to(device), self.position_ids.to(device), mask,
                     self.ignore_index)

    def model_inputs(self) -> dict[str, Any]:
        inputs = {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids,
                  "use_cache": False}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs

    def loss_tokens(self) -> int:
        """Positions that carry loss (the model shifts labels by one)."""
        return int((self.labels[:, 1:] != self.ignore_index).sum())


def _slice(column, doc: int, start: int, length: int) -> list[int]:
    # Only the piece leaves Arrow: a document may be far longer than seq_len.
    return column[doc].values.slice(start, length).to_pylist()


def window_row(source: PreparedSource, window: int, seq_len: int, pad_id: int,
               ignore_index: int = IGNORE_INDEX) -> tuple[list[int], ...]:
    """(input_ids, labels, position_ids, attention_mask) of one window, as lists."""
    table = source.tokens
    tokens = table.column("input_ids")
    targets = table.column("labels") if "labels" in table.column_names else tokens
    ids, labels, positions = [], [], []
    for doc, start, length in source.windows.pieces(window):
        ids += _slice(tokens, doc, start, length)
        piece_labels = _slice(targets, doc, start, length)
        piece_labels[0] = ignore_index
        labels += piece_labels
        positions += range(length)
    used, pad = len(ids), seq_len - len(ids)
    mask = [1] * used + [0] * pad
    return ids + [pad_id] * pad, labels + [ignore_index] * pad, positions + list(range(pad)), mask


def make_batch(rows: list[tuple[list[int], ...]], packing: bool, ignore_index: int = IGNORE_INDEX) -> Batch:
    ids, labels, positions, masks = (torch.tensor(column, dtype=torch.long) for column in zip(*rows, strict=True))
    if not packing:
        positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()  # one document per row
    return Batch(ids, labels, positions, None if packing else masks, ignore_index)


class TrainStream:
    """The mixed, shuffled, resumable stream of training windows."""

    def __init__(self, sources: list[PreparedSource], weights: list[float], *, seq_len: int, packing: bool,
                 pad_id: int, seed: int, ignore_index: int = IGNORE_INDEX) -> None:
        self.sources, self.seq_len, self.packing, self.pad_id = sources, seq_len, packing, pad_id
        self.ignore_index = ignore_index
        self.seed = seed
        self.mixture = Mixture(weights, [len(s.windows) for s in sources], seed)
        self.consumed = 0  # windows taken, over all data shards

    def windows_at(self, start: int, count: int) -> list[tuple[int, int]]:
        return [self.mixture.at(position) for position in range(start, start + count)]

    def batch_at(self, start: int, count: int) -> Batch:
        rows = [window_row(self.sources[s], w, self.seq_len, self.pad_id, self.ignore_index)
                for s, w in self.windows_at(start, count)]
        return make_batch(rows, self.packing, self.ignore_index)

    def next_batch(self, micro_batch: int, dp_rank: int, dp_size: int) -> Batch:
        """This shard's ``micro_batch`` rows of the next global batch."""
        batch = self.batch_at(self.consumed + dp_rank * micro_batch, micro_batch)
        self.consumed += micro_batch * dp_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed, "identities": [s.identity for s in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        legacy = "identities" not in state  # it names cache keys, which cannot be compared with identities
        if legacy:
            same = len(state.get("sources", ())) == len(self.sources)
        else:
            same = state["identities"] == [s.identity for s in self.sources]
        if not same or state.get("seed") != self.seed:
            raise ConfigError("data", {"seed": self.seed, "sources": [s.spec.path for s in self.sources]},
                              "resume with the job's own data, tokenizer and run.seed, or with --resume none",
                              reason="the checkpoint was written for other data")
        if legacy:
            _log.warning("the checkpoint's data position comes from a version without data identities: its data "
                         "cannot be checked and is taken to be this job's")
        self.consumed = int(state["consumed"])


class EvalSet:
    """The held-out windows in order; every evaluation reads the same first batches."""

    def __init__(self, sources: list[PreparedSource], *, seq_len: int, packing: bool, pad_id: int,
                 ignore_index: int = IGNORE_INDEX) -> None:
        self.index = [(s, w) for s, source in enumerate(sources) for w in range(len(source.windows))]
        self.sources, self.seq_len, self.packing, self.pad_id = sources, seq_len, packing, pad_id
        self.ignore_index = ignore_index

    def batches(self, micro_batch: int, dp_rank: int, dp_size: int, count: int) -> list[Batch]:
        """``count`` micro-batches of this shard; every shard gets as many (their forwards
        run collectives together), so the set must hold ``count`` global batches."""
        needed = count * micro_batch * dp_size
        if len(self.index) < needed:
            raise ConfigError("data.eval.batches", count, f"use at most {len(self.index) // (micro_batch * dp_size)}"
                              " or add held-out data", reason=f"the eval set has {len(self.index)} windows, and "
                              f"{count} batches of {micro_batch} rows on {dp_size} data shards need {needed}")
        out = []
        for b in range(count):
            start = (b * dp_size + dp_rank) * micro_batch
            rows = [window_row(self.sources[s], w, self.seq_len, self.pad_id, self.ignore_index)
                    for s, w in self.index[start:start + micro_batch]]
            out.append(make_batch(rows, self.packing, self.ignore_index))
        return out
