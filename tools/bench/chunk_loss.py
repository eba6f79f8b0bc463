"""Chunked cross-entropy vs naive ``F.cross_entropy(hidden @ W.T)`` and torch's ``linear_cross_entropy``.

Forward + backward of the loss head at T=4096 tokens, H=2048, V=128256 (Llama-3's
vocabulary), float32, CPU. For each implementation it prints:

- the peak extra memory (CPU allocator events, deterministic): the peak during forward +
  backward minus what every implementation ends holding (the gradients of the hidden
  states and the weight), divided by naive's; goal <= 0.05;
- the time of one forward + backward, divided by naive's (median of ``--repeats``,
  runs interleaved); goal <= 1.0.

    python tools/bench/chunk_loss.py [--tokens 4096 --hidden 2048 --vocab 128256 --chunk 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from report import result
from torch.profiler import ProfilerActivity, profile

from fsdp_turbo.memory.chunk_loss import chunked_cross_entropy


def naive(h, w, y, chunk):
    return F.cross_entropy(h @ w.t(), y)


def ours(h, w, y, chunk):
    return chunked_cross_entropy(h, w, y, chunk_size=chunk, backend="turbo")


def torch_lce(h, w, y, chunk):
    return F.linear_cross_entropy(h, w, y, options=torch.nn.LinearCrossEntropyOptions())


def _inputs(tokens, hidden, vocab):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[::7] = -100
    return h, w, y


def _run(fn, h, w, y, chunk) -> float:
    h.grad = w.grad = None
    loss = fn(h, w, y, chunk)
    loss.backward()
    return float(loss.detach())


def peak_extra_bytes(fn, h, w, y, chunk) -> int:
    """Allocator-level peak of one forward + backward, minus what it ends holding (the gradients).

    The CPU allocator's events come from the profiler, not from MemTracker: torch's
    ``linear_cross_entropy`` is a custom op whose inner allocations a dispatch-level
    tracker cannot see. Both are deterministic on CPU.
    """
    h.grad = w.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run(fn, h, w, y, chunk)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak - current


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="skip torch's linear_cross_entropy")
    args = parser.parse_args()
    h, w, y = _inputs(args.tokens, args.hidden, args.vocab)
    impls = {"naive F.cross_entropy": naive, f"ours (chunk {args.chunk})": ours}
    if hasattr(F, "linear_cross_entropy") and not args.no_torch:
        impls["torch linear_cross_entropy (chunked)"] = torch_lce
    losses = {name: _run(fn, h, w, y, args.chunk) for name, fn in impls.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            started = time.perf_counter()
            _run(fn, h, w, y, args.chunk)
            times[name].append(time.perf_counter() - started)
    memory = {name: peak_extra_bytes(fn, h, w, y, args.chunk) for name, fn in impls.items()}
    base_name = next(iter(impls))
    base_time, base_mem = statistics.median(times[base_name]), memory[base_name]
    print(f"chunk_loss: T={args.tokens} H={args.hidden} V={args.vocab} fp32 on {torch.get_num_threads()} threads")
    print(f"{'implementation':40s} {'loss':>10s} {'extra MiB':>10s} {'mem/naive':>10s} {'time s':>8s} "
          f"{'time/naive':>10s}")
    for name in impls:
        t = statistics.median(times[name])
        print(f"{name:40s} {losses[name]:10.5f} {memory[name] / 2**20:10.1f} {memory[name] / base_mem:10.3f} "
              f"{t:8.2f} {t / base_time:10.3f}")
        if name == base_name:
            continue
        shape = f"T={args.tokens} H={args.hidden} V={args.vocab}, chunk {args.chunk}"
        result(f"chunked loss peak memory, {name} vs naive", memory[name] / base_mem, "<= 0.05", shape)
        result(f"chunked loss time, {name} vs naive", t / base_time, "<= 1.0", shape)


if __name__ == "__main__":
    main()
