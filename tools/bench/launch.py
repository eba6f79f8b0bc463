"""What starting a job costs: ``fsdp-turbo train`` (torchrun's agent in the launcher, the ranks
forked from a forkserver that imported torch, transformers and the worker once: ``cli.main.run_agent``)
against plain torchrun starting the same worker module in a fresh interpreter per rank
(``python -m torch.distributed.run --standalone --nproc-per-node N -m fsdp_turbo.cli.worker JOB``,
how the command launched until it forked them), for the same tiny job (a Llama of 8 layers, 3
steps, FSDP over every rank). Both runs train from scratch; the data cache is made before either
is measured, and plain torchrun skips the launcher's own checks, which favours the baseline.

Measured: the CPU time of the whole machine while each command runs (``/proc/stat``; nothing
else may run), and its wall time, each the median of ``--repeats`` alternating runs. Printed: the
CPU ratio, ours over torchrun's, at 2 and 4 ranks (on the test suite's two cores, CPU time is
what a launch takes from the other tests).

    python tools/bench/launch.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from report import result

MODEL = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "tie_word_embeddings": False}


def _job(folder: Path) -> Path:
    job = {"model": {"config": MODEL},
           "data": {"files": ["stdlib:*.py"], "seq_len": 32, "max_bytes": 200_000, "cache_dir": str(folder / "cache")},
           "optimizer": {"lr": 0.003, "warmup_steps": 1},
           "run": {"steps": 3, "micro_batch": 2, "seed": 0}, "logging": {"plot": False},
           "checkpoint": {"save_every": 0}, "turbo": {"fully_shard_parallel_size": -1},
           "output_dir": str(folder / "out")}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _busy_seconds() -> float:
    """CPU seconds the machine has spent busy (user, nice, system, irq, softirq) since boot."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _measured(command: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run of ``command``."""
    busy, started = _busy_seconds(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - started, _busy_seconds() - busy
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as folder:
        job = _job(Path(folder))
        ours = [sys.executable, "-m", "fsdp_turbo.cli.main", "train", str(job), "--resume", "none"]
        subprocess.run([sys.executable, "-m", "fsdp_turbo.cli.main", "data", str(job), "--show", "0"],
                       capture_output=True, check=True)  # the data cache, made before anything is measured
        for ranks in (2, 4):
            commands = {
                "fsdp-turbo train": [*ours, "--nproc-per-node", str(ranks)],
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), "-m", "fsdp_turbo.cli.worker", str(job), "--resume", "none"],
            }
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
            for _ in range(args.repeats):  # alternating, so a drift of the machine hits both alike
                for name, command in commands.items():
                    runs[name].append(_measured(command))
            cpu = {name: statistics.median(c for c, _ in measured) for name, measured in runs.items()}
            wall = {name: statistics.median(w for _, w in measured) for name, measured in runs.items()}
            for name in commands:
                print(f"{ranks} ranks, {name:16s}: {cpu[name]:6.1f} s of CPU, {wall[name]:6.1f} s wall "
                      f"(median of {args.repeats})")
            result(f"launch, {ranks} ranks: CPU seconds of fsdp-turbo train vs plain torchrun",
                   cpu["fsdp-turbo train"] / cpu["torchrun"], "reported",
                   f"{cpu['fsdp-turbo train']:.1f} vs {cpu['torchrun']:.1f} s; wall {wall['fsdp-turbo train']:.1f} "
                   f"vs {wall['torchrun']:.1f} s")


if __name__ == "__main__":
    main()
