"""What checkpoints cost a run of ``fsdp-turbo train``: synchronous saves against saves written in the
background (``checkpoint.async_save``), on 2 ranks, a Llama of about 58M parameters, 16 steps.

Three runs of the same job, in this order, each a fresh command: no checkpoint but the last one
(``save_every: 0``); a checkpoint every 4 steps, synchronous; the same in the background. The
cost of the three extra saves is each run's training-loop time (rank 0's log: every step, every
checkpoint, and the wait for the last one; not the start or the export, whose time varies more
from run to run than the saves cost) less the first run's. The ratio is the background saves'
cost over the synchronous saves' (goal <= 0.35); the commands' wall times are printed too.
Then, checked and printed:
the three runs' losses are equal, the last checkpoint of the background run is complete, and a
run resumed from its step-8 checkpoint repeats steps 9 to 16.

    python tools/bench/checkpoint_save.py [--steps 16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


def _job(steps: int, save_every: int, background: bool, cache: Path) -> dict:
    return {"model": {"config": MODEL},
            "data": {"files": ["stdlib:*.py"], "seq_len": 256, "max_bytes": 4_000_000, "cache_dir": str(cache)},
            "optimizer": {"lr": 3e-4, "warmup_steps": 2},
            "run": {"steps": steps, "micro_batch": 4, "seed": 0},
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


def _losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: row["loss"] for row in rows}


def _checkpoints(folder: Path) -> dict[int, Path]:
    found = {}
    for step in (folder / "out" / "checkpoints").glob("*/step-*"):
        if step.is_dir() and not step.name.endswith(".partial") and (step / "meta.json").is_file():
            found[int(step.name.split("-")[1])] = step
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--keep", help="keep the runs in this folder")
    args = parser.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    cache = root / "data-cache"
    every = args.steps // 4
    _train(root / "warm", _job(2, 0, False, cache))  # tokenizes the data once, into the shared cache
    seconds = {name: _train(root / name, _job(args.steps, save, background, cache))
               for name, save, background in (("none", 0, False), ("sync", every, False), ("async", every, True))}
    extra_saves = len(range(every, args.steps, every))
    print(f"command wall time: {seconds['none']:.1f} s with the last checkpoint only; {seconds['sync']:.1f} s with "
          f"{extra_saves} more, synchronous; {seconds['async']:.1f} s with them in the background")
    loop = {name: _loop_seconds(root / name) for name in seconds}
    sync_cost, async_cost = loop["sync"] - loop["none"], loop["async"] - loop["none"]
    print(f"training loop: {loop['none']:.1f} s with the last checkpoint only; {loop['sync']:.1f} s synchronous; "
          f"{loop['async']:.1f} s in the background")
    result(f"cost of {extra_saves} extra checkpoints to the training loop, background vs synchronous (58M Llama, "
           "2 ranks)", async_cost / sync_cost, "<= 0.35",
           f"{async_cost:.1f} vs {sync_cost:.1f} s over {loop['none']:.1f} s")
    waits = {name: _waited(root / name) for name in ("sync", "async")}
    extra_steps = range(every, args.steps, every)
    waited = {name: sum(waits[name][step] for step in extra_steps) for name in waits}
    print(f"the loop waited at the extra checkpoints: {waited['sync']:.2f} s synchronous, {waited['async']:.2f} s in "
          f"the background (per save: {[waits['sync'][s] for s in extra_steps]} vs "
          f"{[waits['async'][s] for s in extra_steps]})")
    result(f"time the loop waited at {extra_saves} extra checkpoints, background vs synchronous", waited["async"] /
           waited["sync"], "reported", f"{waited['async']:.2f} vs {waited['sync']:.2f} s")

    losses = {name: _losses(root / name) for name in seconds}
    same = losses["none"] == losses["sync"] == losses["async"]
    print(f"losses of the three runs equal, step by step: {same}")
    saved = _checkpoints(root / "async")
    print(f"background run's complete checkpoints: steps {sorted(saved)}")
    resumed = root / "resumed"
    _train(resumed, _job(args.steps, every, True, cache), "--resume", str(saved[2 * every]))
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
