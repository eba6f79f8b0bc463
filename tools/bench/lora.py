"""LoRA and QLoRA-MX (PEFT) through FSDPTurbo vs full fine-tuning of the same model on the same layout.

4 gloo ranks (spawned by the shared harness), FSDP=4, float32, a small Llama (hidden 512,
4 layers, ``MODEL`` below). LoRA: PEFT's ``get_peft_model`` with r=16 on every attention
and MLP projection (q/k/v/o, gate/up/down), PEFT's default init (``lora_B`` zero, so both
models start at the same loss, which is checked). QLoRA-MX: the same LoRA model with
``quantization_plan.store_frozen_weights`` (E4M3, blocks of 32) over the projections' frozen
weights. The baseline is full fine-tuning: the same base model from the same seed, the same
FSDPTurbo config. Each side's AdamW takes the parameters that train (all of them for full
fine-tuning, the adapters for LoRA and QLoRA-MX).

Printed, each as LoRA / full fine-tuning with both raw values:

- model-state bytes per rank after one real step, the largest rank: the total of
  parameters + gradients + AdamW states, then each of the three alone. Measured as the
  bytes of the distinct storages behind each rank's local shards (torch's MemTracker
  cannot track a model with frozen parameters: it hooks every parameter's gradient); for
  full fine-tuning MemTracker measures it too, as ``model_state.py`` does, and the two are
  printed side by side (the script stops if they differ). The goal column is the figure
  expected from element counts (unsharded / 4, no padding):
  parameters (base + adapters) / base, gradients and AdamW states adapters / base;
  QLoRA-MX the same with the projections' weights at 1 + 1/32 bytes per element instead of 4;
- the frozen projections' all-gather bytes, QLoRA-MX / LoRA, both with FSDP mixed precision
  ``param_dtype=bfloat16`` (LoRA all-gathers them in bf16, the usual setting; QLoRA-MX in MX
  bytes): per gather, the bytes FSDP puts into the collective for those weights (its
  all-gather inputs, times the ranks); goal <= 0.55. Also every all-gather byte of one
  training step (``all_gather_single`` outputs, adapters and norms included), for scale;
- step time (forward + backward + AdamW step, between barriers): median of the paired
  ratios, steps alternating between the two models after warm-up, so that machine
  noise hits both alike. No goal: LoRA skips the frozen weights' gradients, their
  reduce-scatter and their AdamW update, but FSDP still gathers the frozen base in forward
  and backward (the input gradients need it) and the adapters add small matmuls. QLoRA-MX
  adds the dequantization of every frozen weight in forward and backward (portable kernels).

    python tools/bench/lora.py [--steps 12] [--rows 2] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from report import paired_ratio, result, timed_step

WORLD = 4
WARMUP = 2
RANK = 16
MODEL = {"vocab_size": 1024, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = {"fully_shard_parallel_size": WORLD}
QLORA_PLAN = {"quant_format": "E4M3", "block_size": 32, "apply_modules": [f"*.{t}" for t in TARGETS],
              "store_frozen_weights": True}
CONFIGS = {"full": CONFIG, "lora": CONFIG, "qlora": {**CONFIG, "quantization_plan": QLORA_PLAN}}
BF16 = {"fsdp_plan": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}
SETUPS = ("lora", "full", "qlora")
KINDS = ("PARAM", "GRAD", "OPT")


def build(kind: str):
    """The base model (same seed on every rank and for every kind), LoRA-wrapped but for ``"full"``."""
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    model = tiny_hf_causal_lm("llama", **MODEL)
    if kind != "full":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # the adapters' init, the same in every process
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS))
    return model


def trained(kind: str, extra: dict | None = None):
    """``build(kind)`` through FSDPTurbo (its config, plus ``extra``) with an AdamW over the parameters that train."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo({**CONFIGS[kind], **(extra or {})}, build(kind))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optimizer


def tokens(rows: int, seq_len: int) -> torch.Tensor:
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(dist.get_rank())
    return torch.randint(0, MODEL["vocab_size"], (rows, seq_len), generator=generator)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard; FSDP's
    padding of uneven shards counts, a storage shared by views counts once)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def model_state_bytes(kind: str, ids: torch.Tensor) -> dict[str, int]:
    """Parameters, gradients and AdamW states on this rank after one real step, by storage sums.
    (MemTracker, which model_state.py uses, registers a gradient hook on every parameter and so
    raises on a frozen one; it still measures full fine-tuning, as ``memtracker_bytes`` does.)"""
    model, optimizer = trained(kind)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return {"PARAM": storage_bytes(model.parameters()),
            "GRAD": storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "OPT": storage_bytes(t for state in optimizer.state.values() for t in state.values()
                                 if isinstance(t, torch.Tensor))}


def memtracker_bytes(ids: torch.Tensor) -> int:
    """Full fine-tuning's model state measured by MemTracker, as model_state.py does: a cross-check."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer = trained("full")
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        snapshot = {str(k): v for per_device in tracker.get_tracker_snapshot("current").values()
                    for k, v in per_device.items()}
    return sum(snapshot.get(f"_MemRefType.{kind}", 0) for kind in KINDS)


def step_times(ids: torch.Tensor, steps: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Timed steps of the three models in turn, the order rotating each step (fresh models, untouched
    by MemTracker), and their first loss."""
    setups = {kind: trained(kind) for kind in SETUPS}
    with torch.no_grad():
        losses = {kind: model(input_ids=ids, labels=ids).loss.item() for kind, (model, _) in setups.items()}
    times = {kind: [] for kind in SETUPS}
    for step in range(WARMUP + steps):
        for kind in SETUPS[step % 3:] + SETUPS[:step % 3]:
            elapsed = timed_step(*setups[kind], ids)
            if step >= WARMUP:
                times[kind].append(elapsed)
    return times, losses


def _frozen_gather_inputs(model) -> int:
    """Bytes FSDP puts into the all-gathers, per gather, for the projections' frozen weights (their
    all-gather inputs, times the ranks; after the cast to param_dtype where FSDP casts)."""
    from torch.distributed.fsdp import FSDPModule

    bases = {id(m) for name, m in model.named_modules() if any(name.endswith(f"{t}.base_layer") for t in TARGETS)}
    total = 0
    for unit in model.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            info = fsdp_param._module_info
            if id(info.module) in bases and info.param_name == "weight":
                inputs = fsdp_param.all_gather_inputs
                total += sum(t.numel() * t.element_size() for t in inputs) * group.mesh_info.shard_mesh_size
    return total


def gather_bytes(kind: str, ids: torch.Tensor) -> dict[str, int]:
    """Under bf16 mixed precision, after one step: the frozen projections' all-gather bytes per gather, and
    every byte all-gathered during the next step (``all_gather_single`` outputs, counted by wrapping it)."""
    import torch.distributed as dist

    model, optimizer = trained(kind, BF16)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    frozen = _frozen_gather_inputs(model)
    counted, original = [0], dist.all_gather_single

    def counting(output, *args, **kwargs):
        counted[0] += output.numel() * output.element_size()
        return original(output, *args, **kwargs)

    dist.all_gather_single = counting
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        dist.all_gather_single = original
    return {"frozen": frozen, "step": counted[0]}


def rank_main(steps: int, rows: int, seq_len: int) -> dict:
    ids = tokens(rows, seq_len)
    memory = {kind: model_state_bytes(kind, ids) for kind in SETUPS}
    tracked = memtracker_bytes(ids)
    gathered = {kind: gather_bytes(kind, ids) for kind in ("lora", "qlora")}
    times, losses = step_times(ids, steps)
    return {"memory": memory, "memtracker_full": tracked, "gathered": gathered, "times": times, "losses": losses}


def element_counts() -> tuple[int, int, int]:
    """Unsharded element counts: the base model's, the adapters' (what LoRA trains), and the frozen
    projections' (what QLoRA-MX stores in MX)."""
    lora = build("lora")
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    projections = sum(m.weight.numel() for name, m in lora.named_modules()
                      if any(name.endswith(f"{t}.base_layer") for t in TARGETS))
    return sum(p.numel() for p in lora.parameters()) - adapters, adapters, projections


def _largest(per_rank: list[dict], kind: str) -> dict[str, int]:
    # each side's largest rank (padding of uneven shards lands there), as in model_state.py
    return max((rank["memory"][kind] for rank in per_rank), key=lambda m: sum(m.values()))


def report_memory(per_rank: list[dict], base: int, adapters: int) -> None:
    lora, full = _largest(per_rank, "lora"), _largest(per_rank, "full")
    mib = 2**20
    tracked = max(rank["memtracker_full"] for rank in per_rank)
    print(f"full fine-tuning, largest rank: storage sums {sum(full.values()) / mib:.3f} MiB, "
          f"MemTracker {tracked / mib:.3f} MiB")
    if tracked != sum(full.values()):
        raise SystemExit(f"storage sums and MemTracker disagree on full fine-tuning: {full} vs {tracked}")
    for name, memory in (("LoRA", lora), ("full", full)):
        print(f"{name}: largest rank's model state {sum(memory.values()) / mib:.3f} MiB = "
              + ", ".join(f"{k.lower()} {memory[k] / mib:.3f}" for k in KINDS) + " MiB")
    # expected per rank from element counts: full = 4 x base (param, grad, 2 AdamW), LoRA = base + 4 x adapters
    expected = {"PARAM": (base + adapters) / base, "GRAD": adapters / base, "OPT": adapters / base}
    total_expected = (base + 4 * adapters) / (4 * base)
    ratio = sum(lora.values()) / sum(full.values())
    print(f"model state LoRA / full = {ratio:.3f} (expected from element counts {total_expected:.3f}; "
          f"{adapters:,} adapter vs {base:,} base elements)")
    result(f"model-state bytes per rank (params + grads + AdamW), LoRA r={RANK} vs full fine-tuning, FSDP={WORLD}",
           ratio, f"{total_expected:.3f} (element counts)",
           f"{sum(lora.values()) / mib:.3f} vs {sum(full.values()) / mib:.3f} MiB")
    labels = {"PARAM": "parameter", "GRAD": "gradient", "OPT": "AdamW-state"}
    for kind in KINDS:
        result(f"{labels[kind]} bytes per rank, LoRA r={RANK} vs full fine-tuning, FSDP={WORLD}",
               lora[kind] / full[kind], f"{expected[kind]:.3f} (element counts)",
               f"{lora[kind] / mib:.3f} vs {full[kind] / mib:.3f} MiB")


def report_qlora(per_rank: list[dict], base: int, adapters: int, projections: int) -> None:
    """QLoRA-MX's model state vs full fine-tuning, and the frozen weights' all-gather bytes vs LoRA in bf16."""
    qlora, full = _largest(per_rank, "qlora"), _largest(per_rank, "full")
    mib = 2**20
    packed = 1 + 1 / QLORA_PLAN["block_size"]  # bytes per element: codes + one E8M0 scale per block
    expected_params = (packed * projections + 4 * (base - projections + adapters)) / (4 * base)
    expected = (packed * projections + 4 * (base - projections) + 16 * adapters) / (16 * base)
    print(f"QLoRA-MX: largest rank's model state {sum(qlora.values()) / mib:.3f} MiB = "
          + ", ".join(f"{k.lower()} {qlora[k] / mib:.3f}" for k in KINDS) + " MiB")
    result(f"model-state bytes per rank, QLoRA-MX (E4M3) r={RANK} vs full fine-tuning, FSDP={WORLD}",
           sum(qlora.values()) / sum(full.values()), f"{expected:.3f} (element counts)",
           f"{sum(qlora.values()) / mib:.3f} vs {sum(full.values()) / mib:.3f} MiB")
    result(f"parameter bytes per rank, QLoRA-MX (E4M3) r={RANK} vs full fine-tuning, FSDP={WORLD}",
           qlora["PARAM"] / full["PARAM"], f"{expected_params:.3f} (element counts)",
           f"{qlora['PARAM'] / mib:.3f} vs {full['PARAM'] / mib:.3f} MiB")
    ours, theirs = per_rank[0]["gathered"]["qlora"], per_rank[0]["gathered"]["lora"]
    print(f"all-gather bytes, bf16 mixed precision: frozen projections per gather {ours['frozen']:,} (QLoRA-MX) vs "
          f"{theirs['frozen']:,} (LoRA); one training step, every all-gather {ours['step']:,} vs {theirs['step']:,}")
    result(f"frozen-weight all-gather bytes, QLoRA-MX (E4M3) vs LoRA with param_dtype=bf16, FSDP={WORLD}",
           ours["frozen"] / theirs["frozen"], "<= 0.55",
           f"{ours['frozen'] / mib:.3f} vs {theirs['frozen'] / mib:.3f} MiB per gather")
    result(f"all-gather bytes of a training step (every parameter), QLoRA-MX vs LoRA with param_dtype=bf16, "
           f"FSDP={WORLD}", ours["step"] / theirs["step"], "reported",
           f"{ours['step'] / mib:.3f} vs {theirs['step'] / mib:.3f} MiB")


def report_time(per_rank: list[dict]) -> None:
    # A step ends at a barrier, so every rank measures the same wall time; use rank 0's.
    times, losses = per_rank[0]["times"], per_rank[0]["losses"]
    if abs(losses["lora"] - losses["full"]) > 1e-5 * abs(losses["full"]):
        raise SystemExit(f"LoRA (lora_B zero) and the base model disagree before training: {losses}")
    print(f"first losses: {losses} (QLoRA-MX's base is the E4M3-quantized one)")
    lora, full = statistics.median(times["lora"]), statistics.median(times["full"])
    paired = paired_ratio(times["lora"], times["full"])
    print(f"median step LoRA {lora * 1e3:.1f} ms, full fine-tuning {full * 1e3:.1f} ms; ratio of medians "
          f"{lora / full:.3f}, median paired ratio {paired:.3f} ({len(times['lora'])} pairs)")
    result(f"step time (fwd + bwd + AdamW), LoRA r={RANK} vs full fine-tuning, FSDP={WORLD}", paired, "reported",
           f"{lora * 1e3:.1f} vs {full * 1e3:.1f} ms")
    qlora = statistics.median(times["qlora"])
    result(f"step time (fwd + bwd + AdamW), QLoRA-MX (E4M3) r={RANK} vs full fine-tuning, FSDP={WORLD}",
           paired_ratio(times["qlora"], times["full"]), "reported", f"{qlora * 1e3:.1f} vs {full * 1e3:.1f} ms")


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    base, adapters, projections = element_counts()
    print(f"world={WORLD} (FSDP) steps={args.steps} rows/rank={args.rows} seq={args.seq_len} model={MODEL}; "
          f"LoRA r={RANK} on {TARGETS}: {adapters:,} trainable of {base + adapters:,} elements "
          f"({adapters / base:.2%} of the base)")
    per_rank = run_distributed(rank_main, WORLD, args.steps, args.rows, args.seq_len, timeout=900)
    report_memory(per_rank, base, adapters)
    report_qlora(per_rank, base, adapters, projections)
    report_time(per_rank)


if __name__ == "__main__":
    main()
