"""Step time of FSDPTurbo vs hand-applied ``fully_shard`` with identical settings.

4 gloo ranks (spawned by the shared harness), a small Llama, float32. Both models
are built from the same seed, wrapped once each, and trained in alternating steps
so that machine noise hits both alike. Prints the median step time of each and
the ratio ours / hand-written (goal: <= 1.02).

    python tools/bench/fsdp_overhead.py [--steps 60] [--world 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WARMUP = 3
MODEL = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}
PREFETCH = {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}


def hand_written(model):
    """What a user writes by hand: fully_shard each decoder layer, then the root, with prefetch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for index, layer in enumerate(layers):
        if index + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[index + 1]])
        if index > 0:
            layer.set_modules_to_backward_prefetch([layers[index - 1]])
    return model


def _timed_step(model, optimizer, tokens) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return time.perf_counter() - started


def rank_main(steps: int, rows: int, seq_len: int):
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    ours = FSDPTurbo({"fully_shard_parallel_size": -1, "fsdp_plan": PREFETCH}, tiny_hf_causal_lm("llama", **MODEL))
    theirs = hand_written(tiny_hf_causal_lm("llama", **MODEL))
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in (("ours", ours), ("theirs", theirs))}
    models = {"ours": ours, "theirs": theirs}
    tokens = torch.randint(0, MODEL["vocab_size"], (rows, seq_len), generator=torch.Generator().manual_seed(0))
    times = {"ours": [], "theirs": []}
    for step in range(WARMUP + steps):
        order = ("ours", "theirs") if step % 2 == 0 else ("theirs", "ours")
        for name in order:
            elapsed = _timed_step(models[name], optimizers[name], tokens)
            if step >= WARMUP:
                times[name].append(elapsed)
    return times


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    per_rank = run_distributed(rank_main, args.world, args.steps, args.rows, args.seq_len, timeout=1800)
    # A step ends at a barrier, so every rank measures the same wall time; use rank 0's.
    times = per_rank[0]
    ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
    # Steps run in adjacent pairs, so the per-pair ratio cancels slow drift of the machine.
    paired = statistics.median(a / b for a, b in zip(times["ours"], times["theirs"], strict=True))
    print(f"world={args.world} steps={args.steps} rows/rank={args.rows} seq={args.seq_len} model={MODEL}")
    print(f"median step: FSDPTurbo {ours * 1e3:.1f} ms, hand-written fully_shard {theirs * 1e3:.1f} ms")
    print(f"ratio of medians FSDPTurbo / hand-written = {ours / theirs:.3f}")
    print(f"median paired ratio FSDPTurbo / hand-written = {paired:.3f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
