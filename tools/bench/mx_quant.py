"""MX block quantization on CPU: the registered kernel vs the plain torch version.

Quantizes one bf16 tensor (4096 x 4096 by default, block 32) with ``quantize_mx``
(the portable ``mx.quantize`` kernel) and with ``reference.quantize_mx_naive``, the
straightforward torch version of the same algorithm (reshape into blocks, amax,
torch.log2 + floor/ceil, divide, clamp, cast; HIF8 rounded and looked up on its grid in float32,
as a plain vectorised encoder would). Both run in the
same process, interleaved so machine noise hits them alike, and must give the same
bytes. Prints the median time, GB/s (input bytes / time) and the speedup.

    python tools/bench/mx_quant.py [--rows 4096 --cols 4096 --reps 5 --naive-reps 3 --threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from report import result

from fsdp_turbo.quantization.mx_formats import quantize_mx
from fsdp_turbo.quantization.mx_formats.reference import quantize_mx_naive

CASES = (("E4M3", "floor"), ("E4M3", "rceil"), ("E5M2", "floor"), ("HIF8", "floor"), ("HIF8", "rceil"))


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5, help="timed runs of the kernel per case")
    parser.add_argument("--naive-reps", type=int, default=3, help="timed runs of the plain version per case")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)).bfloat16()
    nbytes = x.numel() * x.element_size()

    print(f"mx_quant: {args.rows}x{args.cols} bf16 ({nbytes / 2**20:.0f} MiB), block {args.block}, CPU, "
          f"{torch.get_num_threads()} threads; median of {args.reps} (kernel) / {args.naive_reps} (plain torch)")
    print(f"{'format':6s} {'scale':6s} {'kernel ms':>10s} {'GB/s':>6s} {'plain ms':>10s} {'GB/s':>6s} {'speedup':>8s}")
    for fmt, mode in CASES:
        def kernel(fmt=fmt, mode=mode):
            return quantize_mx(x, fmt, args.block, mode)

        def naive(fmt=fmt, mode=mode):
            return quantize_mx_naive(x, fmt, args.block, mode)

        mx, (codes, scale) = kernel(), naive()  # warm-up, and the two must agree bit for bit
        if not (torch.equal(mx.codes, codes) and torch.equal(mx.scale, scale)):
            raise SystemExit(f"{fmt}/{mode}: the kernel and the plain version disagree")
        fast: list[float] = []
        slow: list[float] = []
        for rep in range(max(args.reps, args.naive_reps)):
            if rep < args.reps:
                fast.append(timed(kernel))
            if rep < args.naive_reps:
                slow.append(timed(naive))
        t_fast, t_slow = statistics.median(fast), statistics.median(slow)
        print(f"{fmt:6s} {mode:6s} {t_fast * 1e3:10.1f} {nbytes / t_fast / 1e9:6.2f} "
              f"{t_slow * 1e3:10.1f} {nbytes / t_slow / 1e9:6.2f} {t_slow / t_fast:7.1f}x")
        result(f"MX quantize {fmt} {mode} speed, kernel vs plain torch", t_slow / t_fast, ">= 2",
               f"{args.rows}x{args.cols} bf16, {nbytes / t_fast / 1e9:.2f} GB/s on CPU")


if __name__ == "__main__":
    main()
