"""A skewed router against a uniform one, with and without redundant experts
(``ep_plan.redundant_experts``).

Qwen3-MoE through the facade at FSDP=4 x EP=4 on 4 gloo ranks: 2 layers, hidden 256, 32 experts
of intermediate 1024, top-4 (8 per rank), 4 x 256 tokens per rank; the experts hold most of the
compute, as in Qwen3-MoE-30B-A3B. Two batches:

- **skewed**: every token is the same id, so every token of every layer picks the same 4 experts
  (attention over identical values returns them unchanged): without replicas, those experts'
  ranks compute every routed row of the job;
- **uniform**: random ids (the random router spreads them).

Each batch trains with no replicas and with 3 replica slots per rank (enough for the 4 hot
experts to have a copy on every rank), placed again at every forward (``rebalance_every`` 1):
the router of a fresh model trained on one repeated token changes its 4 experts from step to
step, so a placement kept for longer would be stale here (slowly moving loads are what longer
intervals are for). Runs are interleaved step by step.

What is measured. The step time of the slowest rank, taken as its main thread's CPU time per
step (one intra-op thread per rank). On dedicated accelerators a step lasts as long as its
busiest rank computes, and the others wait; on this 2-core machine, 4 ranks share 2 cores, so
a rank waiting in gloo frees its core for a busy one and wall time hides the imbalance (it is
printed too). Printed: skewed / uniform of that time, without replicas and with them (goal with
them <= 1.25), and the largest loss difference between the runs with and without replicas on
the same batch (training is unchanged: float32 rounding only).

    python tools/bench/moe_skew.py [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from report import result

MODEL = {"hidden_size": 256, "moe_intermediate_size": 1024, "intermediate_size": 1024, "num_experts": 32,
         "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "head_dim": 64, "vocab_size": 1024, "norm_topk_prob": True}
ROWS, SEQ, WORLD, SPARE = 4, 256, 4, 3
RUNS = {"skewed": ("skewed", 0), "uniform": ("uniform", 0),
        "skewed, replicas": ("skewed", SPARE), "uniform, replicas": ("uniform", SPARE)}


def _step(model, optimizer, tokens) -> tuple[float, float, float]:
    """(main-thread CPU seconds, wall seconds between barriers, loss) of one training step."""
    import torch.distributed as dist

    dist.barrier()
    wall, cpu = time.perf_counter(), time.thread_time()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    cpu = time.thread_time() - cpu
    dist.barrier()
    return cpu, time.perf_counter() - wall, float(loss.detach())


def _rank(steps: int) -> dict:
    import torch.distributed as dist

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = {"skewed": torch.full((ROWS, SEQ), 7),
               "uniform": torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=generator)}
    runs = {}
    for name, (batch, spare) in RUNS.items():
        config = {"fully_shard_parallel_size": WORLD, "expert_parallel_size": WORLD,
                  "ep_plan": {"dispatcher": "fused", "redundant_experts": spare, "rebalance_every": 1}}
        torch.manual_seed(0)
        model = FSDPTurbo(config, tiny_hf_causal_lm("qwen3_moe", **MODEL))
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches[batch])
    out = {name: {"cpu": [], "wall": [], "loss": []} for name in RUNS}
    for step in range(steps + 1):  # interleaved, so machine noise hits every run alike
        for name, (model, optimizer, tokens) in runs.items():
            cpu, wall, loss = _step(model, optimizer, tokens)
            if step:  # the first step warms up
                out[name]["cpu"].append(cpu)
                out[name]["wall"].append(wall)
            out[name]["loss"].append(loss)
    return out


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after a warm-up one")
    args = parser.parse_args()
    ranks = run_distributed(_rank, WORLD, args.steps, timeout=1800)
    # Per step, the slowest rank's CPU time; then the median over steps.
    slowest = {name: statistics.median(max(rank[name]["cpu"][i] for rank in ranks) for i in range(args.steps))
               for name in RUNS}
    wall = {name: statistics.median(ranks[0][name]["wall"]) for name in RUNS}
    print(f"moe_skew: Qwen3-MoE {MODEL}, FSDP=4 x EP=4, {ROWS}x{SEQ} tokens per rank, {SPARE} replica slots "
          "per rank; the slowest rank's main-thread CPU time per step (median of steps)")
    for name in RUNS:
        per_rank = [round(statistics.median(rank[name]["cpu"]), 3) for rank in ranks]
        print(f"  {name:18s} slowest {slowest[name]:.3f} s, per rank {per_rank}, wall {wall[name]:.3f} s")
    for suffix, goal in (("", "reported"), (", replicas", "<= 1.25")):
        skewed, uniform = slowest[f"skewed{suffix}"], slowest[f"uniform{suffix}"]
        label = "with" if suffix else "without"
        result(f"EP=4 slowest rank's step, skewed vs uniform batch, {label} redundant experts", skewed / uniform,
               goal, f"{skewed:.3f} vs {uniform:.3f} s CPU")
    for batch in ("skewed", "uniform"):
        plain, replicated = ranks[0][batch]["loss"], ranks[0][f"{batch}, replicas"]["loss"]
        gap = max(abs(a - b) / abs(a) for a, b in zip(plain, replicated, strict=True))
        print(f"  {batch}: losses {[round(x, 5) for x in plain]} without replicas, largest relative gap with "
              f"them {gap:.1e}")
    result("EP=4 uniform step, redundant experts vs none (slowest rank): their cost", slowest["uniform, replicas"] /
           slowest["uniform"], "reported", f"{slowest['uniform, replicas']:.3f} vs {slowest['uniform']:.3f} s CPU")
    result("EP=4 skewed step, redundant experts vs none (slowest rank)", slowest["skewed, replicas"] /
           slowest["skewed"], "reported", f"{slowest['skewed, replicas']:.3f} vs {slowest['skewed']:.3f} s CPU")


if __name__ == "__main__":
    main()
