"""The training data: local text files, byte tokens, packed windows, a resumable order.

Every file's bytes are joined with a newline and cut into ``seq_len`` windows (packing: no
padding). A seeded permutation fixes the global order of windows for each epoch; a step
takes the next ``micro_batch x dp_size`` windows of that order, and data shard ``dp_rank``
takes its ``micro_batch`` of them. The loader's whole state is the number of windows
consumed, so it resumes exactly, and also under another world size or layout.

Why not ``torch.utils.data.DataLoader`` (or torchdata's ``StatefulDataLoader``): with the
order fixed by one integer there is nothing to prefetch or shard that a list slice does
not already do, and a worker pool's state would be harder to save than that integer.
"""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import torch

from fsdp_turbo.core.errors import ConfigError

STDLIB = "stdlib:"


def resolve_files(patterns: list[str]) -> list[Path]:
    """The files the globs match, sorted (the same order on every rank and every run)."""
    files: set[Path] = set()
    for pattern in patterns:
        if pattern.startswith(STDLIB):
            pattern = str(Path(sysconfig.get_paths()["stdlib"]) / pattern[len(STDLIB):])
        files.update(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        raise ConfigError("data.files", patterns, "give globs that match local text files", reason="no file matches")
    return sorted(files)


def byte_tokens(files: list[Path], max_bytes: int) -> torch.Tensor:
    """Byte-level tokens (vocab 256) of the files, joined by newlines, at most ``max_bytes``."""
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    joined = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8).long()


class PackedWindows:
    """Fixed-length windows of a token stream in a seeded order, consumed by position."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        count = tokens.numel() // seq_len
        if count < 1:
            raise ConfigError("data.seq_len", seq_len, "use a shorter sequence or more data",
                              reason=f"the corpus has {tokens.numel()} tokens")
        self.windows = tokens[: count * seq_len].view(count, seq_len)
        self.seed = seed
        self.consumed = 0  # windows taken, over all data shards
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.windows.shape[0]

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self), generator=generator)}  # keep one epoch
        return self._orders[epoch]

    def _take(self, start: int, count: int) -> torch.Tensor:
        rows = [int(self._order(index // len(self))[index % len(self)]) for index in range(start, start + count)]
        return self.windows[torch.tensor(rows)]

    def next_batch(self, micro_batch: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """This shard's ``[micro_batch, seq_len]`` of the next global batch."""
        start = self.consumed + dp_rank * micro_batch
        batch = self._take(start, micro_batch)
        self.consumed += micro_batch * dp_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed, "windows": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["windows"] != len(self) or state["seed"] != self.seed:
            raise ConfigError("data", self.state_dict(),
                              "resume with the job's own data and run.seed, or with --resume none",
                              reason=f"the checkpoint was written for other data ({state})")
        self.consumed = int(state["consumed"])
