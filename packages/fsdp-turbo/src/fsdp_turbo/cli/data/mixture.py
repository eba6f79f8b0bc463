"""The global order of training windows: a pure function of (seed, position).

Position *i* of the stream is drawn from a source by weight; it is that source's
*k*-th draw, where *k* counts the earlier positions that drew it, and it is window
``permutation(epoch)[k % windows]`` of that source, ``epoch = k // windows``. Draws are
made in blocks of ``BLOCK`` from a generator seeded by (seed, block), so any position is
found from the per-block counts without replaying the stream. The order does not depend
on the world size: a loader resumed at another data-parallel size continues it exactly.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 4096


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + key) % (2**63)
    return torch.Generator().manual_seed(seed)


class Mixture:
    def __init__(self, weights: list[float], windows: list[int], seed: int) -> None:
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.windows = windows  # windows per source
        self.seed = seed
        self._counts = [np.zeros(len(windows), dtype=np.int64)]  # draws per source before each block
        self._block: tuple[int, np.ndarray] | None = None
        self._perm: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, permutation)

    def _draws(self, block: int) -> np.ndarray:
        if self._block is None or self._block[0] != block:
            if len(self.weights) == 1:
                draws = np.zeros(BLOCK, dtype=np.int64)
            else:
                draws = torch.multinomial(self.weights, BLOCK, replacement=True,
                                          generator=_generator(self.seed, 1, block)).numpy()
            self._block = (block, draws)
        return self._block[1]

    def _counts_before(self, block: int) -> np.ndarray:
        while len(self._counts) <= block:
            done = len(self._counts) - 1
            self._counts.append(self._counts[done] + np.bincount(self._draws(done), minlength=len(self.windows)))
        return self._counts[block]

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        cached = self._perm.get(source)
        if cached is None or cached[0] != epoch:
            order = torch.randperm(self.windows[source], generator=_generator(self.seed, 2, source, epoch)).numpy()
            self._perm[source] = cached = (epoch, order)
        return cached[1]

    def at(self, position: int) -> tuple[int, int]:
        """(source, window) at ``position`` of the stream."""
        block, offset = divmod(position, BLOCK)
        draws = self._draws(block)
        source = int(draws[offset])
        k = int(self._counts_before(block)[source]) + int((draws[:offset] == source).sum())
        epoch, index = divmod(k, self.windows[source])
        return source, int(self._permutation(source, epoch)[index])
