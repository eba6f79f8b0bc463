"""Expert-parallel dispatchers on one MoE layer: 64 experts, top-8, hidden 1024, 4 gloo ranks.

Each rank holds 16 experts (EP=4) and routes its own tokens with a Qwen3-MoE router. One
step is forward + backward of the MoE block. Printed, from the same run:

- tokens/s of ``fused`` / ``eager`` (goal >= 3x), ``mc2`` / ``fused`` and ``domino`` / ``fused``;
- all-to-all bytes each rank sends to other ranks per step, dispatch and combine, divided
  by the theoretical minimum ``tokens x top_k x hidden x bytes x (ep - 1) / ep`` each way
  (goal 1.00; the router decides the real split, so a few percent either way is routing
  imbalance, not waste). The per-expert count exchange (E int64 per rank) is listed apart.
  ``domino`` sends the same rows through its own async exchanges, which are not counted.

    python tools/bench/ep_dispatch.py [--tokens 256] [--steps 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from report import result

EXPERTS, TOP_K, HIDDEN, INTER, WORLD = 64, 8, 1024, 256, 4


def _block(dtype: torch.dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block.to(dtype)


def rank_job(dispatcher: str, tokens: int, steps: int, dtype_name: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.expert_parallel import apply_expert_parallel, dispatchers
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    block = _block(dtype)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
    apply_expert_parallel(block, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher), mesh)
    sent = {"dispatch": 0, "combine": 0}
    original_all_to_all, original_send_rows = dispatchers.all_to_all, dispatchers.send_rows
    dispatched: set[int] = set()

    def tagging_send_rows(hidden, route):
        rows = original_send_rows(hidden, route)
        dispatched.add(id(rows))
        return rows

    def counting_all_to_all(x, recv_splits, send_splits, group):
        # Python sees forward calls only (backward is the collective's autograd); count the
        # rows that leave this rank.
        kind = "dispatch" if id(x) in dispatched else "combine"
        sent[kind] += (sum(send_splits) - send_splits[rank]) * x.shape[-1] * x.element_size()
        return original_all_to_all(x, recv_splits, send_splits, group)

    def counting(on: bool) -> None:
        dispatchers.all_to_all = counting_all_to_all if on else original_all_to_all
        dispatchers.send_rows = tagging_send_rows if on else original_send_rows

    generator = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(1, tokens, HIDDEN, generator=generator).to(dtype).requires_grad_()
    times = []
    for step in range(steps + 1):
        counting(step == steps)
        dist.barrier()
        start = time.perf_counter()
        out = block(x)
        out.float().square().mean().backward()
        dist.barrier()
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
    counting(False)
    return {"time": statistics.median(times), "sent": sent, "elem": x.element_size()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    from fsdp_turbo.core.testing import run_distributed

    results = {}
    for dispatcher in ("eager", "fused", "mc2", "domino"):
        ranks = run_distributed(rank_job, WORLD, dispatcher, args.tokens, args.steps, args.dtype, timeout=900)
        results[dispatcher] = ranks
    tokens_per_s = {d: WORLD * args.tokens / max(r["time"] for r in ranks) for d, ranks in results.items()}
    print(f"MoE layer: {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, expert FFN {INTER}, EP={WORLD}, "
          f"{args.tokens} tokens/rank, {args.dtype}, forward + backward")
    for dispatcher, rate in tokens_per_s.items():
        print(f"  {dispatcher:6s} {rate:10.0f} tokens/s")
    print(f"fused / eager: {tokens_per_s['fused'] / tokens_per_s['eager']:.2f}x (goal >= 3x)")
    print(f"mc2 / fused:   {tokens_per_s['mc2'] / tokens_per_s['fused']:.2f}x")
    print(f"domino / fused: {tokens_per_s['domino'] / tokens_per_s['fused']:.2f}x")
    shape = f"{EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, EP={WORLD}, {args.tokens} tokens/rank"
    result("EP dispatch tokens/s, fused vs eager", tokens_per_s["fused"] / tokens_per_s["eager"], ">= 3", shape)
    result("EP dispatch tokens/s, mc2 vs fused", tokens_per_s["mc2"] / tokens_per_s["fused"], "-",
           "overlap needs an async device; gloo on 2 cores serialises it")
    result("EP dispatch tokens/s, domino vs fused", tokens_per_s["domino"] / tokens_per_s["fused"], "-",
           "forward and backward overlap; needs an async device to pay off")
    elem = results["fused"][0]["elem"]
    theory = args.tokens * TOP_K * HIDDEN * elem * (WORLD - 1) / WORLD
    for dispatcher in ("fused", "mc2"):
        for way in ("dispatch", "combine"):
            ratios = [r["sent"][way] / theory for r in results[dispatcher]]
            print(f"{dispatcher} {way} all-to-all bytes / theory per rank: "
                  + " ".join(f"{v:.3f}" for v in ratios) + f" (mean {statistics.mean(ratios):.3f}; goal 1.00)")
            result(f"EP all-to-all bytes, {dispatcher} {way} vs theory", statistics.mean(ratios), "1.00",
                   "mean over ranks; the router sets the split")
    print(f"count exchange: {EXPERTS * 8} bytes per rank per exchange (mc2: one exchange for all chunks)")


if __name__ == "__main__":
    main()
