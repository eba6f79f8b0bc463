"""Activation memory and step time of full and selective recompute vs none.

One process, a Llama-shaped model (float32, CPU). For each policy: the activation bytes
alive after forward and the peak during forward + backward (MemTracker, deterministic),
and the median step time (forward + backward, policies interleaved so machine noise
hits all alike). Every figure is printed as a ratio to no recompute.

    python tools/bench/recompute.py [--layers 4 --hidden 512 --seq 512 --batch 4 --steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from report import result
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.memory.recompute import apply_recompute

POLICIES = ("none", "full", "selective")


def build(policy: str, args):
    model = tiny_hf_causal_lm("llama", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
                              intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                              num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                              head_dim=64)
    if policy != "none":
        apply_recompute(model.model.layers, policy)
    return model


def step(model, ids) -> None:
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def memory(model, ids) -> tuple[int, int]:
    """(activation bytes after forward, activation+temporary peak during forward + backward)."""
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        after_forward = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    model.zero_grad(set_to_none=True)
    kinds = {str(k): v for k, v in after_forward.items()}
    peak_kinds = {str(k): v for k, v in peak.items()}
    return kinds["_MemRefType.ACT"], peak_kinds["Total"] - peak_kinds["_MemRefType.PARAM"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    models = {policy: build(policy, args) for policy in POLICIES}
    mem = {policy: memory(model, ids) for policy, model in models.items()}
    times: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for model in models.values():
        step(model, ids)  # warm-up
    for _ in range(args.steps):
        for policy, model in models.items():
            started = time.perf_counter()
            step(model, ids)
            times[policy].append(time.perf_counter() - started)
    base_act, base_peak = mem["none"]
    base_time = statistics.median(times["none"])
    print(f"recompute: llama {args.layers}x{args.hidden}, batch {args.batch} x seq {args.seq}, fp32 CPU, "
          f"{torch.get_num_threads()} threads")
    print(f"{'policy':10s} {'act after fwd MiB':>18s} {'ratio':>6s} {'peak (no params) MiB':>21s} {'ratio':>6s} "
          f"{'step s':>7s} {'ratio':>6s}")
    for policy in POLICIES:
        act, peak = mem[policy]
        t = statistics.median(times[policy])
        print(f"{policy:10s} {act / 2**20:18.1f} {act / base_act:6.3f} {peak / 2**20:21.1f} {peak / base_peak:6.3f} "
              f"{t:7.2f} {t / base_time:6.3f}")
        if policy == "none":
            continue
        shape = f"llama {args.layers}x{args.hidden}, {args.batch}x{args.seq} tokens"
        result(f"recompute {policy}: activations after forward vs none", act / base_act, "-", shape)
        result(f"recompute {policy}: peak memory (params excluded) vs none", peak / base_peak, "-", shape)
        result(f"recompute {policy}: step time vs none", t / base_time, "-", shape)


if __name__ == "__main__":
    main()
