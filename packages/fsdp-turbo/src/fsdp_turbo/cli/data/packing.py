"""From document lengths to ``seq_len`` windows: small pure functions on numpy arrays.

A *piece* is a run of one document's tokens ``(doc, start, length)``. A document longer
than ``seq_len`` becomes several pieces (``split``), its first piece (``truncate``) or an
error. A *window* is a list of pieces whose lengths sum to at most ``seq_len``; the rest of
it is padding. Windows are stored in CSR form: ``offsets[w]:offsets[w + 1]`` index the
pieces of window ``w``.

Packing is first-fit over the last ``OPEN_WINDOWS`` windows, in document order: a piece
goes into the first of them with room, else opens a new one. Bounded, so it is linear in
the number of documents, and deterministic. Without packing every piece is its own window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdp_turbo.core.errors import ConfigError

OPEN_WINDOWS = 64


@dataclass(frozen=True)
class Windows:
    doc: np.ndarray  # int64 [pieces]: the document (row of the tokenized table) of each piece
    start: np.ndarray  # int64 [pieces]: the piece's first token within its document
    length: np.ndarray  # int64 [pieces]
    offsets: np.ndarray  # int64 [windows + 1]: CSR bounds of each window's pieces
    dropped_tokens: int  # tokens cut off by ``truncate``

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def pieces(self, window: int) -> list[tuple[int, int, int]]:
        low, high = self.offsets[window], self.offsets[window + 1]
        return list(zip(self.doc[low:high].tolist(), self.start[low:high].tolist(),
                        self.length[low:high].tolist(), strict=True))


def cut_documents(lengths: np.ndarray, seq_len: int, overflow: str, where: str
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(doc, start, length) of every piece, and the tokens dropped. Empty documents vanish."""
    lengths = np.asarray(lengths, dtype=np.int64)
    long = np.flatnonzero(lengths > seq_len)
    if len(long) and overflow == "error":
        first = int(long[0])
        raise ConfigError("data.overflow", "error", "set data.overflow to split or truncate, or raise data.seq_len",
                          reason=f"{where} row {first} has {int(lengths[first])} tokens, more than seq_len "
                                 f"{seq_len} ({len(long)} such documents)")
    if overflow == "truncate":
        kept = np.minimum(lengths, seq_len)
        counts = (kept > 0).astype(np.int64)
        dropped = int((lengths - kept).sum())
    else:
        kept, counts, dropped = lengths, -(-lengths // seq_len), 0
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # index of each document's first piece
    rank = np.arange(len(doc), dtype=np.int64) - np.repeat(first, counts)  # piece number within its document
    start = rank * seq_len
    length = np.minimum(np.repeat(kept, counts) - start, seq_len)
    return doc, start, length, dropped


def pack(doc: np.ndarray, start: np.ndarray, length: np.ndarray, seq_len: int, packing: bool,
         dropped: int = 0) -> Windows:
    if not packing:
        return Windows(doc, start, length, np.arange(len(doc) + 1, dtype=np.int64), dropped)
    window_of = np.empty(len(doc), dtype=np.int64)
    open_ids: list[int] = []  # the windows still open, oldest first
    room: list[int] = []
    windows = 0
    for index, size in enumerate(length.tolist()):
        slot = next((k for k, free in enumerate(room) if free >= size), None)
        if slot is None:
            open_ids.append(windows)
            room.append(seq_len)
            windows += 1
            slot = len(room) - 1
            if len(room) > OPEN_WINDOWS:
                del open_ids[0], room[0]
                slot -= 1
        window_of[index] = open_ids[slot]
        room[slot] -= size
    order = np.argsort(window_of, kind="stable")  # pieces grouped by window, in document order within one
    counts = np.bincount(window_of, minlength=windows)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Windows(doc[order], start[order], length[order], offsets, dropped)
