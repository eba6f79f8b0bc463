"""Bytes each collective moves in one training step of FSDP=2 x TP=2, against theory.

4 gloo ranks, a small Llama (float32), q/k/v and gate/up colwise, o/down rowwise.
A dispatch mode sees every collective of one step (forward + backward) on rank 0:
FSDP2 issues c10d ops, DTensor (TP) issues functional collectives. Payload bytes
are counted the usual way: all-gather = gathered output, reduce-scatter and
all-reduce = input.

Theory (float32, per rank):
- FSDP: all-gather of every parameter's TP-local shard in forward, again in
  backward for the decoder layers (the root keeps its parameters), and one
  reduce-scatter of every gradient;
- TP: per decoder layer, two all-reduces of [B, S, H] in forward (o_proj, down_proj)
  and two in backward (the attention and MLP inputs); with sequence parallel each
  becomes an all-gather plus a reduce-scatter, plus one all-gather where the
  sequence-sharded region starts (backward) and one where it ends (forward). The
  sequence-parallel norms' weight-gradient all-reduces (a few KB) are not in theory.

    python tools/bench/comm_volume.py
"""

from __future__ import annotations

from collections import defaultdict

import torch
from report import result
from torch.utils._python_dispatch import TorchDispatchMode

MODEL = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}
ROWS, SEQ = 2, 128
PLAN = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
        "rowwise_parallel": ["*.o_proj", "*.down_proj"]}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    """Payload bytes per (library, collective) seen while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if name.startswith("c10d::"):
            kind = name.split("::")[1].strip("_").split(".")[0]
            if "allgather" in kind:
                self.bytes[("fsdp", "all_gather")] += _nbytes(args[0])
            elif "reduce_scatter" in kind:
                self.bytes[("fsdp", "reduce_scatter")] += _nbytes(args[1])
            elif "allreduce" in kind:
                self.bytes[("fsdp", "all_reduce")] += _nbytes(args[0])
        elif name.startswith("_c10d_functional::"):
            kind = name.split("::")[1].split(".")[0]
            if kind == "all_gather_into_tensor":
                self.bytes[("tp", "all_gather")] += _nbytes(args[0]) * int(args[1])
            elif kind == "reduce_scatter_tensor":
                self.bytes[("tp", "reduce_scatter")] += _nbytes(args[0])
            elif kind in ("all_reduce", "all_reduce_"):
                self.bytes[("tp", "all_reduce")] += _nbytes(args[0])
        return func(*args, **kwargs)


def _theory(model, tp: int, sequence_parallel: bool) -> dict[str, int]:
    from torch.distributed.tensor import Shard

    gather_fwd = gather_bwd = 0
    for name, param in model.named_parameters():
        tp_sharded = isinstance(param.placements[-1], Shard)
        local = param.numel() // (tp if tp_sharded else 1) * param.element_size()
        gather_fwd += local
        if name.startswith("model.layers."):
            gather_bwd += local
    activation = ROWS * SEQ * MODEL["hidden_size"] * 4
    # Per layer: attention and MLP each need one all-reduce in forward and one in backward;
    # with SP each all-reduce becomes an all-gather plus a reduce-scatter (same wire bytes,
    # twice the payload by this count).
    tp_bytes = MODEL["num_hidden_layers"] * 2 * 2 * activation * (2 if sequence_parallel else 1)
    if sequence_parallel:
        # Entering the region costs one all-gather of the grads in backward; leaving it
        # (before the head) one all-gather in forward.
        tp_bytes += 2 * activation
    return {"fsdp": gather_fwd + gather_bwd + gather_fwd, "tp": tp_bytes}


def rank_main(sequence_parallel: bool):
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    plan = dict(PLAN, sequence_parallel=["*layernorm", "model.norm"]) if sequence_parallel else PLAN
    model = FSDPTurbo({"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": plan},
                      tiny_hf_causal_lm("llama", **MODEL))
    tokens = torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()  # warm-up: lazy init outside the count
    model.zero_grad(set_to_none=True)
    counter = CollectiveBytes()
    with counter:
        model(input_ids=tokens, labels=tokens).loss.backward()
    return dict(counter.bytes), _theory(model, 2, sequence_parallel)


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    for sequence_parallel in (False, True):
        measured, theory = run_distributed(rank_main, 4, sequence_parallel, timeout=600)[0]
        label = "FSDP=2 x TP=2" + (" + sequence parallel" if sequence_parallel else "")
        print(f"{label}: rows={ROWS} seq={SEQ} model={MODEL}")
        for group in ("fsdp", "tp"):
            got = sum(v for (g, _), v in measured.items() if g == group)
            detail = ", ".join(f"{k}={v / 1e6:.3f} MB" for (g, k), v in sorted(measured.items()) if g == group)
            print(f"  {group:4s} measured {got / 1e6:8.3f} MB  theory {theory[group] / 1e6:8.3f} MB  "
                  f"ratio {got / theory[group]:.3f}   ({detail})")
        total = sum(measured.values())
        print(f"  total ratio {total / sum(theory.values()):.3f} (goal 1.00)")
        result(f"collective bytes per step, {label} (4 ranks) vs theory", total / sum(theory.values()), "1.00",
               f"{total / 1e6:.2f} vs {sum(theory.values()) / 1e6:.2f} MB per rank")


if __name__ == "__main__":
    main()
