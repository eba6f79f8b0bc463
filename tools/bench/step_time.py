"""Step time of FSDPTurbo vs the same parallelism written by hand with torch's own APIs.

4 gloo ranks (spawned by the shared harness), a small Llama, float32. Two layouts:

- ``fsdp``: FSDP over every rank; by hand, ``fully_shard`` on each decoder layer and the
  root with explicit forward/backward prefetch of the neighbouring layer;
- ``fsdp_tp``: FSDP=2 x TP=2; by hand, ``parallelize_module`` with torch's
  ``ColwiseParallel`` (q/k/v, gate/up) and ``RowwiseParallel`` (o, down) on the TP
  submesh, then the same ``fully_shard`` units on the FSDP submesh.

Both models are built from the same seed, wrapped once each, and trained in alternating
steps so that machine noise hits both alike. Prints the median step time of each and the
median of the per-pair ratios ours / hand-written (goal: <= 1.02).

    python tools/bench/step_time.py [--steps 60] [--layouts fsdp fsdp_tp]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from report import paired_ratio, result, timed_step

WARMUP = 3
MODEL = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}
PREFETCH = {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}
COLWISE, ROWWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
CONFIGS = {
    "fsdp": {"fully_shard_parallel_size": -1, "fsdp_plan": PREFETCH},
    "fsdp_tp": {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "fsdp_plan": PREFETCH,
                "tp_plan": {"colwise_parallel": [f"*.{n}" for n in COLWISE],
                            "rowwise_parallel": [f"*.{n}" for n in ROWWISE]}},
}


def hand_written(model, layout: str):
    """What a user writes by hand with torch's APIs, with the same settings as ``CONFIGS``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if layout == "fsdp_tp":
        mesh2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("fsdp", "tp"))
        mesh = mesh2d["fsdp"]
        for layer in model.model.layers:
            plan = {f"self_attn.{n}" if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else f"mlp.{n}":
                    (ColwiseParallel() if n in COLWISE else RowwiseParallel()) for n in COLWISE + ROWWISE}
            parallelize_module(layer, mesh2d["tp"], plan)
    else:
        mesh = init_device_mesh("cpu", (world,))
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


def rank_main(layout: str, steps: int, rows: int, seq_len: int):
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    models = {"ours": FSDPTurbo(CONFIGS[layout], tiny_hf_causal_lm("llama", **MODEL)),
              "theirs": hand_written(tiny_hf_causal_lm("llama", **MODEL), layout)}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    tokens = torch.randint(0, MODEL["vocab_size"], (rows, seq_len), generator=torch.Generator().manual_seed(0))
    losses = {name: models[name](input_ids=tokens, labels=tokens).loss.item() for name in models}
    times = {"ours": [], "theirs": []}
    for step in range(WARMUP + steps):
        order = ("ours", "theirs") if step % 2 == 0 else ("theirs", "ours")
        for name in order:
            elapsed = timed_step(models[name], optimizers[name], tokens)
            if step >= WARMUP:
                times[name].append(elapsed)
    return times, losses


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layouts", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    print(f"world={args.world} steps={args.steps} rows/rank={args.rows} seq={args.seq_len} model={MODEL}")
    for layout in args.layouts:
        per_rank = run_distributed(rank_main, args.world, layout, args.steps, args.rows, args.seq_len, timeout=1800)
        # A step ends at a barrier, so every rank measures the same wall time; use rank 0's.
        times, losses = per_rank[0]
        if abs(losses["ours"] - losses["theirs"]) > 1e-4 * abs(losses["theirs"]):
            raise SystemExit(f"{layout}: the two models disagree before training: {losses}")
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["theirs"])
        paired = paired_ratio(times["ours"], times["theirs"])
        print(f"{layout}: median step FSDPTurbo {ours * 1e3:.1f} ms, hand-written {theirs * 1e3:.1f} ms; "
              f"ratio of medians {ours / theirs:.3f}, median paired ratio {paired:.3f} (goal <= 1.02)")
        result(f"step time, {layout} ({args.world} ranks) vs hand-written torch", paired, "<= 1.02",
               f"{ours * 1e3:.1f} vs {theirs * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
