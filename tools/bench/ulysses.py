"""Ulysses context parallel on one Llama decoder layer: sequence 8192, hidden 1024, 16 heads
(MHA), 4 gloo ranks at CP=4, against the same model without CP in one process.

Printed, from the same run:

- all-to-all bytes each rank sends to other ranks per attention layer in forward, divided by
  the theory ``4 x B x S x H x bytes x (cp - 1) / cp^2`` (Q, K, V and the output; goal 1.00);
- peak activation memory per rank (MemTracker; parameters and gradients excluded) during
  forward + backward, divided by the no-CP peak (goal <= 1/cp plus the replicated parts).

    python tools/bench/ulysses.py [--seq 8192] [--cp 4]
"""

from __future__ import annotations

import argparse

import torch
from report import result as report
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

MODEL = {"vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 1,
         "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64, "max_position_embeddings": 16384}


class AllToAllBytes(TorchDispatchMode):
    """Bytes of functional all-to-alls that leave this rank (equal splits)."""

    def __init__(self, cp: int) -> None:
        super().__init__()
        self.cp, self.sent, self.calls = cp, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "_c10d_functional::all_to_all_single":
            tensor = args[0]
            self.sent += tensor.numel() * tensor.element_size() * (self.cp - 1) // self.cp
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _model():
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    return tiny_hf_causal_lm("llama", **MODEL)


def peak_activation_bytes(model, **inputs) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(**inputs).loss.backward()
        peak = {str(k): v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    model.zero_grad(set_to_none=True)
    return peak["Total"] - peak.get("_MemRefType.PARAM", 0) - peak.get("_MemRefType.GRAD", 0)


def _batch(seq: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))


def reference_job(seq: int) -> int:
    ids = _batch(seq)
    return peak_activation_bytes(_model(), input_ids=ids, labels=ids, use_cache=False)


def cp_job(seq: int, cp: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.context_parallel import apply_context_parallel

    model = _model()
    apply_context_parallel(model, None, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    ids = _batch(seq)
    counter = AllToAllBytes(cp)
    with counter, torch.no_grad():
        model(input_ids=ids, labels=ids, use_cache=False)
    peak = peak_activation_bytes(model, input_ids=ids, labels=ids, use_cache=False)
    return {"sent": counter.sent, "calls": counter.calls, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=4)
    args = parser.parse_args()
    from fsdp_turbo.core.testing import run_distributed, run_reference

    baseline = run_reference(reference_job, args.seq, timeout=1800)
    ranks = run_distributed(cp_job, args.cp, args.seq, args.cp, timeout=1800)
    hidden, layers, elem = MODEL["hidden_size"], MODEL["num_hidden_layers"], 4
    theory = 4 * 1 * args.seq * hidden * elem * (args.cp - 1) / args.cp**2
    print(f"Llama layer: hidden {hidden}, {MODEL['num_attention_heads']} heads, sequence {args.seq}, "
          f"CP={args.cp}, float32, sdpa")
    for rank, result in enumerate(ranks):
        per_layer = result["sent"] / layers
        print(f"rank {rank}: all-to-all bytes per attention layer / theory = {per_layer / theory:.3f} "
              f"({result['calls'] // layers} all-to-alls per layer in forward; goal 1.00); "
              f"peak activation memory / no-CP = {result['peak'] / baseline:.3f} "
              f"({result['peak'] / 2**20:.0f} MiB vs {baseline / 2**20:.0f} MiB; goal <= {1 / args.cp:.2f} + "
              "replicated parts)")
    first = ranks[0]
    report(f"Ulysses all-to-all bytes per attention layer, CP={args.cp} vs theory",
           first["sent"] / layers / theory, "1.00", f"sequence {args.seq}, hidden {hidden}")
    report(f"Ulysses peak activation memory per rank, CP={args.cp} vs no CP", first["peak"] / baseline,
           f"<= {1 / args.cp:.2f} + replicated", f"{first['peak'] / 2**20:.0f} vs {baseline / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
