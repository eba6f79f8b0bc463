"""Pipeline parallel's bubble and the bytes its stages exchange, each against the schedule's
theory: a Llama of 8 layers (hidden 256, vocab 4096), 8 rows of 256 tokens a step, PP=2 on 2
gloo ranks (one thread each, as one device a stage), float32, through
``model.fsdp_turbo_pipeline.step``.

Printed, per schedule and micro-batch count ``m``:
- the bubble: ``1 - (W / p) / T``. ``T`` is the pipeline's step (forward and backward);
  ``W`` is the fair baseline, measured in the same run by one rank while the other waits,
  in pairs with the pipeline's steps (6 pairs after 2 warm-up ones; the median of the
  pairs' ratios): the same model in one process, plain PyTorch, running
  the same ``m`` micro-batches forward and backward one after another (gradient
  accumulation), so ``W / p`` is a perfect pipeline's step. Theory, the idle share of a
  step: ``(p - 1) / (v m + p - 1)`` for GPipe and 1F1B (``v = 1``) and interleaved 1F1B
  (``v`` stages a rank); ZBV's is 0 once ``m >= 2p`` with equal forward, input-gradient and
  weight-gradient times. The ratio printed is ``T / (W / p)``, whose theory is
  ``1 / (1 - bubble)``: beyond it is what the schedule and the sends cost;
- bytes sent between stages in one step (every ``c10d::send`` of both ranks) over the theory:
  each micro-batch's hidden states forward and their gradient backward across every stage
  boundary that joins two ranks (``S - 1`` boundaries for ``S`` looped stages, ``S - 2`` for a
  V, whose turn stays on one rank): ``boundaries x 2 x rows x seq x hidden x 4`` (goal 1.00).

    python tools/bench/pipeline.py
"""

from __future__ import annotations

import statistics
import time

import torch
from report import paired_ratio, result
from torch.utils._python_dispatch import TorchDispatchMode

MODEL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False}
ROWS, SEQ, PP = 8, 256, 2
SCHEDULES = [("gpipe", 4), ("1f1b", 4), ("1f1b", 8), ("interleaved_1f1b", 4), ("interleaved_1f1b", 8),
             ("zbv", 4), ("zbv", 8)]
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2}
WARMUP, STEPS = 2, 6


class SentBytes(TorchDispatchMode):
    """Bytes this rank sends point to point."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "c10d::send":
            self.sent += sum(t.numel() * t.element_size() for t in args[0])
        return func(*args, **(kwargs or {}))


def _tokens() -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(0))


def _timed(run) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - started


def _accumulated(microbatches: int):
    """The baseline's step, on this rank alone: the whole model, plain PyTorch,
    ``microbatches`` forward and backward passes of the step's rows one after another."""
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    model, tokens = tiny_hf_causal_lm("llama", seed=0, **MODEL), _tokens()
    items = (tokens[:, 1:]).numel()

    def step() -> None:
        for rows in tokens.chunk(microbatches):
            model(input_ids=rows, labels=rows, num_items_in_batch=items).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def pipeline_job(schedule: str, microbatches: int) -> dict:
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    torch.set_num_threads(1)  # one core a rank, as one device a stage: the baseline too
    config = {"pipeline_parallel_size": PP, "pipeline_schedule": schedule, "pipeline_microbatches": microbatches}
    model = FSDPTurbo(config, tiny_hf_causal_lm("llama", seed=0, **MODEL))
    runner, tokens = model.fsdp_turbo_pipeline, _tokens()
    baseline = _accumulated(microbatches)

    def step() -> None:
        runner.step(tokens, tokens)
        for part in runner.parts:
            part.zero_grad(set_to_none=True)

    # in adjacent pairs, so the machine's drift cancels in each pair's ratio (report.paired_ratio)
    pairs = [(_timed(step), _timed(baseline)) for _ in range(WARMUP + STEPS)][WARMUP:]
    counter = SentBytes()
    with counter:
        step()
    return {"times": [p for p, _ in pairs], "baseline": [b for _, b in pairs], "sent": counter.sent}


def _theory_bubble(schedule: str, microbatches: int) -> float:
    if schedule == "zbv":
        return 0.0
    stages = STAGES_PER_RANK[schedule]
    return (PP - 1) / (stages * microbatches + PP - 1)


def _theory_bytes(schedule: str) -> int:
    stages = PP * STAGES_PER_RANK[schedule]
    boundaries = stages - 2 if schedule == "zbv" else stages - 1
    return boundaries * 2 * ROWS * SEQ * MODEL["hidden_size"] * 4


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    print(f"pipeline parallel: PP={PP} on 2 gloo ranks, Llama {MODEL['num_hidden_layers']} layers x "
          f"{MODEL['hidden_size']}, {ROWS} x {SEQ} tokens a step")
    for schedule, microbatches in SCHEDULES:
        ranks = run_distributed(pipeline_job, PP, schedule, microbatches, timeout=1800)
        steps = [max(r["times"][i] for r in ranks) for i in range(STEPS)]
        ratio = paired_ratio(steps, [b / PP for b in ranks[0]["baseline"]])  # T / (W / p)
        step, work = statistics.median(steps), statistics.median(ranks[0]["baseline"])
        bubble, theory = 1 - 1 / ratio, _theory_bubble(schedule, microbatches)
        sent, expected = sum(r["sent"] for r in ranks), _theory_bytes(schedule)
        label = f"{schedule}, m={microbatches}"
        print(f"  {label:22s} step {step * 1e3:7.1f} ms, baseline {work * 1e3:7.1f} ms: bubble "
              f"{bubble:.3f} (theory {theory:.3f}); sent {sent / 2**20:.2f} MiB (theory {expected / 2**20:.2f})")
        result(f"pipeline {label}: step time vs plain PyTorch work / p", ratio,
               f"theory {1 / (1 - theory):.3f}", f"bubble {bubble:.3f}, theory {theory:.3f}; "
               f"{step * 1e3:.0f} vs {work / PP * 1e3:.0f} ms")
        result(f"pipeline {label}: bytes between stages vs theory", sent / expected, "1.00",
               f"{sent / 2**20:.2f} vs {expected / 2**20:.2f} MiB a step")


if __name__ == "__main__":
    main()
