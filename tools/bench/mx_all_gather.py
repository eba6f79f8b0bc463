"""What FSDP all-gathers in MX training, with ``quantization_plan.low_precision_all_gather``
against the same training gathering bf16, and against fp32.

4 gloo ranks, FSDP=4 through the facade, a Llama of 118M parameters whose MX Linears hold 86% of
them, as in Llama 3 8B (87%: the embedding and head are the rest): vocab 8192, hidden 1024, MLP
2816, 8 layers, 16 heads of 64; E4M3 blocks of 32; 1 x 128 tokens per rank (bytes do not depend
on tokens). Every run is MX training, in the same process group, one after another:

- **bf16 gathers**: ``fsdp_plan.param_dtype: bfloat16``, the baseline the issue names;
- **MX bytes**: ``low_precision_all_gather`` (mode ``on-demand``), ``param_dtype: bfloat16`` for
  the parameters that are not MX Linears (embedding, norms, head);
- **MX bytes, both orientations per gather** (mode ``all``);
- **fp32 gathers** (no ``param_dtype``), which MX bytes train exactly as (the tests show it).

Printed: the bytes one rank receives from all-gathers in a training step (forward and backward),
each divided by the bf16 run's (goal for MX bytes: <= 0.60); the plan's estimate of the same
bytes (``fsdp-turbo plan``'s "FSDP all-gathers per rank") against the measurement; and the step
time against bf16's (on CPU gloo a gather costs little beside the emulated MX GEMMs, so this is
the quantization's cost more than the link's saving: reported).

    python tools/bench/mx_all_gather.py [--steps 3]
"""

from __future__ import annotations

import argparse

import torch
from report import paired_ratio, result, timed_step

MODEL = {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64}
ROWS, SEQ = 1, 128
MX = {"quant_format": "E4M3", "block_size": 32}
RUNS = {
    "bf16 gathers": ({}, "bfloat16"),
    "MX bytes": ({"low_precision_all_gather": True}, "bfloat16"),
    "MX bytes, both orientations": ({"low_precision_all_gather": True, "low_precision_all_gather_mode": "all"},
                                    "bfloat16"),
    "fp32 gathers": ({}, None),
}


def _planned_bytes(model) -> int:
    """The plan's estimate (what ``fsdp-turbo plan`` prints) for the model the facade made."""
    from fsdp_turbo.core.memory_estimate import MemoryModel
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    memory = MemoryModel.of(tiny_hf_causal_lm("llama", device="meta", **MODEL), ROWS * SEQ, model.fsdp_turbo_facts)
    for plan in model.fsdp_turbo_plans.values():
        plan.estimate(memory)
    return memory.totals().gathered


def _rank(steps: int) -> dict:
    import torch.distributed as dist

    from fsdp_turbo.core.testing.collectives import AllGatherBytes
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    out, models = {}, {}
    seed = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=seed)
    for name, (gather, dtype) in RUNS.items():
        config = {"fully_shard_parallel_size": 4, "quantization_plan": {**MX, **gather}}
        if dtype:
            config["fsdp_plan"] = {"param_dtype": dtype}
        model = FSDPTurbo(config, tiny_hf_causal_lm("llama", **MODEL))
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        with AllGatherBytes() as received:
            timed_step(*models[name], tokens)
        out[name] = {"bytes": received.received, "planned": _planned_bytes(model), "times": []}
    for _ in range(steps):  # interleaved, so machine noise hits every run alike
        for name in RUNS:
            out[name]["times"].append(timed_step(*models[name], tokens))
    return out


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after the counted one")
    args = parser.parse_args()
    out = run_distributed(_rank, 4, args.steps, timeout=1800)[0]
    bf16 = out["bf16 gathers"]
    print(f"mx_all_gather: FSDP=4, Llama {MODEL}, E4M3/32, {ROWS}x{SEQ} tokens per rank; bytes one rank receives "
          "from all-gathers in a step")
    for name, run in out.items():
        print(f"  {name:30s} {run['bytes'] / 2**20:8.2f} MiB (plan: {run['planned'] / 2**20:8.2f} MiB), "
              f"step {min(run['times']):.3f} s")
    for name, goal in (("MX bytes", "<= 0.60"), ("MX bytes, both orientations", "reported"),
                       ("fp32 gathers", "2.00")):
        run = out[name]
        result(f"FSDP=4 all-gather bytes per step, {name} vs bf16 gathers", run["bytes"] / bf16["bytes"], goal,
               f"{run['bytes'] / 2**20:.2f} vs {bf16['bytes'] / 2**20:.2f} MiB")
    for name, run in out.items():
        result(f"plan's all-gather bytes vs measured, {name}", run["planned"] / run["bytes"], "1.00",
               f"{run['planned'] / 2**20:.2f} vs {run['bytes'] / 2**20:.2f} MiB")
    run = out["MX bytes"]
    result("FSDP=4 step time, MX bytes vs bf16 gathers (CPU gloo)", paired_ratio(run["times"], bf16["times"]),
           "reported", f"{min(run['times']):.3f} vs {min(bf16['times']):.3f} s")


if __name__ == "__main__":
    main()
