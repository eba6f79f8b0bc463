"""One machine-readable line per measured ratio, for ``run_all.py`` to gather into a table.

Each benchmark prints its own human-readable lines as well; these lines start with
``RESULT`` and hold tab-separated fields: metric, ours / baseline, goal, detail.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

PREFIX = "RESULT"


def paired_ratio(ours: Sequence[float], baseline: Sequence[float]) -> float:
    """The median of per-step ratios of steps run in adjacent pairs: pairing cancels the slow
    drift of a shared machine, which a ratio of two medians would keep."""
    return statistics.median(a / b for a, b in zip(ours, baseline, strict=True))


def timed_step(model, optimizer, tokens) -> float:
    """Seconds of one causal-LM training step (forward, backward, optimizer step) between barriers,
    so every rank measures the same wall time."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - started


def result(metric: str, ratio: float, goal: str, detail: str = "") -> None:
    print(f"{PREFIX}\t{metric}\t{ratio:.3f}\t{goal}\t{detail}", flush=True)


def parse(line: str) -> tuple[str, float, str, str] | None:
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 5 or fields[0] != PREFIX:
        return None
    return fields[1], float(fields[2]), fields[3], fields[4]
