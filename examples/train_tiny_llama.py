"""A small real training job: a tiny Llama learns Python source bytes, under FSDP.

Run: torchrun --nproc-per-node 4 --standalone examples/train_tiny_llama.py
The corpus is this interpreter's own standard library (.py files), so nothing is
downloaded. Each data shard (parallel_state.dp_rank) draws its own windows.
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_turbo.core.device import end_process
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig, FSDPTurboConfig


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Byte tokens (vocab 256) of the standard library's .py files, in a fixed order."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batch_for(corpus: torch.Tensor, step: int, dp_rank: int, dp_size: int, rows: int, seq_len: int, seed: int):
    # Every shard draws different windows; the same (seed, step, shard) always gives the same batch.
    generator = torch.Generator().manual_seed(seed + step * dp_size + dp_rank)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (rows,), generator=generator)
    return torch.stack([corpus[s : s + seq_len] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per data shard per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", help="optional YAML/TOML FSDPTurboConfig; default: FSDP over all ranks")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len))
    config = (FSDPTurboConfig.from_file(args.config) if args.config else FSDPTurboConfig(
        fully_shard_parallel_size=-1,
        fsdp_plan=FSDPPlanConfig(num_to_forward_prefetch=1, num_to_backward_prefetch=1)))
    model = FSDPTurbo(config, model)
    state = model.parallel_state
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    corpus = load_corpus(2_000_000)
    rank0 = state.rank == 0
    if rank0:
        print(f"FSDPTurbo demo: {state.describe()}, corpus {corpus.numel():,} bytes", flush=True)

    losses = []
    started = time.perf_counter()
    for step in range(args.steps):
        tokens = batch_for(corpus, step, state.dp_rank, state.dp_size, args.micro_batch, args.seq_len, args.seed)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(float(mean))
        if rank0:
            print(f"step {step + 1:4d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    if rank0:
        elapsed = time.perf_counter() - started
        tokens_total = args.steps * state.dp_size * args.micro_batch * args.seq_len
        print(f"done: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {elapsed:.1f}s "
              f"({tokens_total / elapsed:,.0f} tokens/s)", flush=True)
    # Destroys the process group, then exits without the interpreter's teardown, where
    # gloo's threads can abort a finished worker (see end_process).
    end_process(0)


if __name__ == "__main__":
    main()
