"""``load_pretrained`` / ``save_pretrained`` at real size, on 4 gloo ranks.

A Llama-architecture model of 0.5B parameters, random init, is saved by transformers in
bf16 in several files (with an index). Then, each phase in fresh processes:

- baseline: ``AutoModelForCausalLM.from_pretrained`` on every rank, what a job did before
  (each rank holds the whole model), and in one process (its wall time). transformers maps
  the files and reads a weight only when it is first used, so the baseline reads each
  weight once (a sum) before it stops the clock: the point where a training step could
  start;
- ours: the model built on the meta device, ``FSDPTurbo`` FSDP=4, ``load_pretrained``
  (each rank reads its slices), then ``save_pretrained`` back (transformers' layout).

Memory is each rank's peak RSS growth during the call (``/proc/self/clear_refs`` resets
the high-water mark first; mapped checkpoint pages count, as they do for the OS). Ratios:

- load RSS growth / (checkpoint bytes / 4): goal <= 1.3 (1.0 is exactly the rank's share);
- the same for from_pretrained on every rank: reported (about 4: the whole model);
- load wall time / one-process from_pretrained: goal <= 1.0 (and, reported, against
  from_pretrained on every rank, in the same 4 processes);
- save RSS growth / (checkpoint bytes / 4 + largest output file): goal <= 1.3.

    python tools/bench/load_pretrained.py [--layers 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from report import result

WORLD = 4
CONFIG = {"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_attention_heads": 12,
          "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measured(fn):
    """(result, peak RSS growth in bytes, seconds) of ``fn()``."""
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss("VmRSS")
    started = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - started
    return value, _rss("VmHWM") - before, seconds


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**CONFIG, num_hidden_layers=layers)


def write_checkpoint(directory: Path, layers: int) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(layers)).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="400MB")


def _from_pretrained_and_read(directory: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.sum()  # the first use of each weight reads it from the mapped file
    return model


def from_pretrained_everywhere(directory: str) -> tuple[int, float]:
    _, grew, seconds = _measured(lambda: _from_pretrained_and_read(directory))
    return grew, seconds


def ours(directory: str, out: str, layers: int) -> dict:
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from fsdp_turbo.checkpoint import load_pretrained, save_pretrained
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(layers)).to(torch.bfloat16)
    model = FSDPTurbo({"fully_shard_parallel_size": WORLD}, model)
    dist.barrier()
    report, load_grew, load_seconds = _measured(lambda: load_pretrained(model, directory))
    dist.barrier()
    _, save_grew, save_seconds = _measured(lambda: save_pretrained(model, out, max_shard_size="400MB"))
    return {"load_grew": load_grew, "load_seconds": load_seconds, "read": report.read_bytes,
            "save_grew": save_grew, "save_seconds": save_seconds}


def one_process_seconds(directory: str) -> float:
    started = time.perf_counter()
    _from_pretrained_and_read(directory)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--keep", type=Path, help="write the checkpoints here and keep them")
    args = parser.parse_args()
    from fsdp_turbo.core.testing import run_distributed, run_reference

    root = args.keep or Path(tempfile.mkdtemp(prefix="fsdp_turbo_bench_"))
    try:
        source, out = root / "hf", root / "ours"
        run_reference(write_checkpoint, source, args.layers, timeout=1200)
        files = sorted(source.glob("*.safetensors"))
        total = sum(f.stat().st_size for f in files)
        params = sum(p.numel() for p in _meta_model(args.layers).parameters())
        print(f"checkpoint: {params / 1e9:.2f}B parameters, bf16, {len(files)} files, {total / 2**30:.2f} GiB")
        share = total / WORLD
        baseline = run_distributed(from_pretrained_everywhere, WORLD, str(source), timeout=1200)
        single = min(run_reference(one_process_seconds, str(source), timeout=1200) for _ in range(2))
        mine = run_distributed(ours, WORLD, str(source), str(out), args.layers, timeout=1200)
        largest_file = max(f.stat().st_size for f in out.glob("*.safetensors"))
        worst = {k: max(r[k] for r in mine) for k in ("load_grew", "load_seconds", "save_grew", "read")}
        for rank, r in enumerate(mine):
            print(f"rank {rank}: load read {r['read'] / 2**20:,.0f} MiB, RSS +{r['load_grew'] / 2**20:,.0f} MiB "
                  f"in {r['load_seconds']:.2f} s; save RSS +{r['save_grew'] / 2**20:,.0f} MiB "
                  f"in {r['save_seconds']:.2f} s; from_pretrained RSS +{baseline[rank][0] / 2**20:,.0f} MiB")
        result("load_pretrained RSS growth / (checkpoint / 4)", worst["load_grew"] / share, "<= 1.3",
               f"{worst['load_grew'] / 2**20:,.0f} MiB vs {share / 2**20:,.0f} MiB share")
        result("from_pretrained on every rank: RSS growth / (checkpoint / 4)",
               max(b[0] for b in baseline) / share, "reported", "each rank holds the whole model")
        result("load_pretrained wall / one-process from_pretrained", worst["load_seconds"] / single, "<= 1.0",
               f"{worst['load_seconds']:.2f} s vs {single:.2f} s")
        result("load_pretrained wall / from_pretrained on every rank (same 4 processes)",
               worst["load_seconds"] / max(b[1] for b in baseline), "reported",
               f"{worst['load_seconds']:.2f} s vs {max(b[1] for b in baseline):.2f} s")
        result("save_pretrained RSS growth / (checkpoint / 4 + largest file)",
               worst["save_grew"] / (share + largest_file), "<= 1.3",
               f"{worst['save_grew'] / 2**20:,.0f} MiB vs {(share + largest_file) / 2**20:,.0f} MiB")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def _meta_model(layers: int):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_config(layers))


if __name__ == "__main__":
    main()
