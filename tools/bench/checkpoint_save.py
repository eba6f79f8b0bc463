"""What checkpoints cost a run of ``fsdp-turbo train``: synchronous saves against saves written in the
background (``checkpoint.async_save``), on 2 ranks, a Llama of about 58M parameters, 16 steps of
2 sequences of 64 tokens (short steps: the saves' cost is then large beside a step's variation).

Three runs of the same job, each a fresh command: no checkpoint but the last one
(``save_every: 0``); a checkpoint every 4 steps, synchronous; the same in the background.

The cost of the three extra saves is measured within each run, against that run's own steps,
since step times drift from one run to the next on a shared machine by more than the saves
cost (an earlier form of this script subtracted the first run's loop time, and printed noise):
the time the loop waited at each save (rank 0's log), plus what the two steps after each save
took beyond the run's median step without a save in flight (a background write competes with
them for the machine). The ratio is the background saves' cost over the synchronous saves'
(goal <= 0.35). The loops' and the commands' wall times are printed too. Then, checked and
printed: the three runs' losses are equal, the last checkpoint of the background run is
complete, and a run resumed from its step-8 checkpoint repeats steps 9 to 16.

    python tools/bench/checkpoint_save.py [--steps 16] [--seq-len 64] [--micro-batch 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from report import result

MODEL = {"model_type": "llama", "vocab_size": 28000, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
         "max_position_embeddings": 512, "tie_word_embeddings": False}


def _job(args: argparse.Namespace, save_every: int, background: bool, cache: Path, steps: int | None = None) -> dict:
    return {"model": {"config": MODEL},
            "data": {"files": ["stdlib:*.py"], "seq_len": args.seq_len, "max_bytes": 4_000_000,
                     "cache_dir": str(cache)},
            "optimizer": {"lr": 3e-4, "warmup_steps": 2},
            "run": {"steps": steps or args.steps, "micro_batch": args.micro_batch, "seed": 0},
            "checkpoint": {"save_every": save_every, "keep": 8, "async_save": background},
            "turbo": {"fully_shard_parallel_size": 2}}


WAITED = re.compile(r"checkpoint of step (\d+) .*: the loop waited ([0-9.]+) s")
LOOP = re.compile(r"the training loop ran steps \d+-\d+ in ([0-9.]+) s")


def _waited(folder: Path) -> dict[int, float]:
    """Seconds the training loop waited at each checkpoint (rank 0's log)."""
    return {int(step): float(s) for step, s in WAITED.findall((folder / "stderr.txt").read_text())}


def _loop_seconds(folder: Path) -> float:
    """Seconds of the training loop, its checkpoints included (rank 0's log)."""
    (seconds,) = LOOP.findall((folder / "stderr.txt").read_text())
    return float(seconds)


def _train(folder: Path, job: dict, *extra: str) -> float:
    """Wall seconds of one ``fsdp-turbo train`` command (2 ranks) of ``job`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fsdp_turbo.cli.main", "train", str(path), "--nproc-per-node", "2",
                           "--output-dir", str(folder / "out"), *extra], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.perf_counter() - began
    (folder / "stderr.txt").write_text(done.stderr)
    if done.returncode:
        raise SystemExit(f"fsdp-turbo train failed in {folder}:\n{done.stderr[-4000:]}")
    return seconds


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _losses(folder: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in _metrics(folder)}


AFTER = 2  # steps after a save that a background write may slow


def _save_cost(folder: Path, saves: range) -> tuple[float, float, float]:
    """(waits, excess, quiet) of a run: seconds the loop waited at ``saves``; seconds the ``AFTER``
    steps after each took beyond ``quiet``, the median of the steps with no save in flight
    (step 1, the warm-up, left out)."""
    step_s = {row["step"]: row["step_s"] for row in _metrics(folder)}
    waits = _waited(folder)
    near = {save + k for save in saves for k in range(1, AFTER + 1)}
    quiet = statistics.median(s for step, s in step_s.items() if step > 1 and step not in near)
    return sum(waits[save] for save in saves), sum(step_s[step] - quiet for step in near), quiet


def _checkpoints(folder: Path) -> dict[int, Path]:
    found = {}
    for step in (folder / "out" / "checkpoints").glob("*/step-*"):
        if step.is_dir() and not step.name.endswith(".partial") and (step / "meta.json").is_file():
            found[int(step.name.split("-")[1])] = step
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--keep", help="keep the runs in this folder")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    cache = root / "data-cache"
    every = args.steps // 4
    _train(root / "warm", _job(args, 0, False, cache, steps=2))  # tokenizes the data once, into the shared cache
    seconds = {name: _train(root / name, _job(args, save, background, cache))
               for name, save, background in (("none", 0, False), ("sync", every, False), ("async", every, True))}
    saves = range(every, args.steps, every)
    print(f"command wall time: {seconds['none']:.1f} s with the last checkpoint only; {seconds['sync']:.1f} s with "
          f"{len(saves)} more, synchronous; {seconds['async']:.1f} s with them in the background")
    loop = {name: _loop_seconds(root / name) for name in seconds}
    print(f"training loop: {loop['none']:.1f} s with the last checkpoint only; {loop['sync']:.1f} s synchronous; "
          f"{loop['async']:.1f} s in the background")
    cost, waited = {}, {}
    for name in ("sync", "async"):
        per_save = _waited(root / name)
        waited[name], excess, quiet = _save_cost(root / name, saves)
        cost[name] = waited[name] + excess
        print(f"{name}: the loop waited {waited[name]:.2f} s at the {len(saves)} extra checkpoints (per save: "
              f"{[per_save[s] for s in saves]}); the {AFTER} steps after each took {excess:.2f} s beyond "
              f"the run's median step without a save in flight ({quiet:.2f} s)")
    result(f"cost of {len(saves)} extra checkpoints to the training loop, background vs synchronous (58M Llama, "
           "2 ranks; each run against its own steps)", cost["async"] / cost["sync"], "<= 0.35",
           f"{cost['async']:.2f} vs {cost['sync']:.2f} s")
    result(f"time the loop waited at {len(saves)} extra checkpoints, background vs synchronous", waited["async"] /
           waited["sync"], "reported", f"{waited['async']:.2f} vs {waited['sync']:.2f} s")

    losses = {name: _losses(root / name) for name in seconds}
    same = losses["none"] == losses["sync"] == losses["async"]
    print(f"losses of the three runs equal, step by step: {same}")
    saved = _checkpoints(root / "async")
    print(f"background run's complete checkpoints: steps {sorted(saved)}")
    resumed = root / "resumed"
    _train(resumed, _job(args, every, True, cache), "--resume", str(saved[2 * every]))
    again = _losses(resumed)
    repeated = all(again[step] == losses["async"][step] for step in range(2 * every + 1, args.steps + 1))
    print(f"resumed from step {2 * every} of the background run: steps {2 * every + 1}-{args.steps} repeat "
          f"its losses exactly: {repeated}")
    if not (same and repeated and args.steps in saved):
        raise SystemExit("the runs differ, or the last checkpoint is missing")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
