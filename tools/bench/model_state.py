"""Per-rank model-state bytes (parameters + gradients + AdamW states) vs 1/N of the
unsharded model's, measured by MemTracker after one real step.

The baseline is the same model and optimizer in one process, measured the same way; a
perfectly sharded layout holds exactly 1/N of it on each of its N ranks. Ours is the
largest rank's bytes (padding of uneven shards and replicated leftovers show up here).
Goal: <= 1.05.

    python tools/bench/model_state.py [--layouts fsdp fsdp_tp fsdp_ep]
"""

from __future__ import annotations

import argparse

import torch
from report import result

WORLD = 4
DENSE = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}
MOE = {"vocab_size": 1024, "hidden_size": 256, "moe_intermediate_size": 256, "num_hidden_layers": 4,
       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "num_experts": 8,
       "num_experts_per_tok": 2}
LAYOUTS = {
    "fsdp": ("llama", DENSE, {"fully_shard_parallel_size": WORLD}),
    "fsdp_tp": ("llama", DENSE, {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": {
        "colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
        "rowwise_parallel": ["*.o_proj", "*.down_proj", "model.embed_tokens"]}}),
    "fsdp_ep": ("qwen3_moe", MOE, {"fully_shard_parallel_size": WORLD, "expert_parallel_size": 2,
                                   "ep_plan": {"dispatcher": "fused"}}),
}


def model_state_bytes(model) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        snapshot = {str(k): v for per_device in tracker.get_tracker_snapshot("current").values()
                    for k, v in per_device.items()}
    return sum(snapshot.get(f"_MemRefType.{kind}", 0) for kind in ("PARAM", "GRAD", "OPT"))


def single(kind: str, model_kwargs: dict) -> int:
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    return model_state_bytes(tiny_hf_causal_lm(kind, **model_kwargs))


def rank_main(kind: str, model_kwargs: dict, config: dict) -> int:
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    return model_state_bytes(FSDPTurbo(config, tiny_hf_causal_lm(kind, **model_kwargs)))


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed, run_reference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    for layout in args.layouts:
        kind, model_kwargs, config = LAYOUTS[layout]
        whole = run_reference(single, kind, model_kwargs, timeout=600)
        per_rank = run_distributed(rank_main, WORLD, kind, model_kwargs, config, timeout=600)
        ratio = max(per_rank) / (whole / WORLD)
        print(f"{layout}: one process {whole / 2**20:.2f} MiB; per rank {[round(b / 2**20, 3) for b in per_rank]} "
              f"MiB; largest / (whole / {WORLD}) = {ratio:.3f} (goal <= 1.05)")
        result(f"model-state bytes per rank, {layout} ({WORLD} ranks) vs 1/N", ratio, "<= 1.05",
               f"{max(per_rank) / 2**20:.2f} vs {whole / WORLD / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
