"""Every benchmark, one command, one table: ``python tools/bench/run_all.py [--write]``.

Each row is ours / baseline, both measured in the same run of the same script (see each
script's docstring for its baseline). ``--write`` records the table in
``tools/bench/RESULTS.md`` with the date and the machine. ``--only NAME ...`` runs some.
Scripts run one after another (they time things: never two at once).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from report import parse

HERE = Path(__file__).parent
# name -> arguments: the configurations the issues ask for.
BENCHES = {
    "step_time": [],
    "model_state": [],
    "comm_volume": [],
    "chunk_loss": ["--repeats", "2"],
    "mx_quant": [],
    "ep_dispatch": [],
    "ulysses": [],
    "recompute": [],
    "load_pretrained": [],
    "data_pipeline": [],
    "context_parallel": [],
    "peer_torchtitan": [],
    "lora": [],
    "checkpoint_save": [],
    "mx_all_gather": [],
    "moe_skew": [],
    "memory_model": [],
    "pipeline": [],
    "launch": [],
}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
            f"Python {platform.python_version()}, {platform.system()}")


def run(name: str, args: list[str]) -> tuple[list[tuple[str, float, str, str]], float, str]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *args], capture_output=True, text=True,
                          cwd=HERE.parent.parent)
    rows = [row for row in map(parse, proc.stdout.splitlines()) if row is not None]
    note = "" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    return rows, time.perf_counter() - started, note


def table(results: dict[str, list[tuple[str, float, str, str]]]) -> str:
    lines = ["| benchmark | measurement (ours ÷ baseline) | ratio | goal | detail |", "|---|---|---|---|---|"]
    for name, rows in results.items():
        for metric, ratio, goal, detail in rows:
            lines.append(f"| {name} | {metric} | {ratio:.3f} | {goal} | {detail} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(BENCHES))
    parser.add_argument("--write", action="store_true", help="record the table in tools/bench/RESULTS.md")
    options = parser.parse_args()
    results, notes = {}, []
    for name in options.only or BENCHES:
        rows, seconds, note = run(name, BENCHES[name])
        results[name] = rows
        print(f"{name}: {len(rows)} rows in {seconds:.0f} s {note}".rstrip(), file=sys.stderr, flush=True)
        if note or not rows:
            notes.append(f"- {name}: no result ({note or 'no RESULT lines'})")
    text = table(results)
    print(text)
    for note in notes:
        print(note)
    if options.write:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        section = (f"## CPU run, {stamp}\n\nMachine: {machine()}.\nCommand: `python tools/bench/run_all.py"
                   f"{' --only ' + ' '.join(options.only) if options.only else ''} --write`\n\n{text}\n"
                   + ("\n" + "\n".join(notes) + "\n" if notes else ""))
        path = HERE / "RESULTS.md"
        head = path.read_text().split("\n## ", 1)[0].rstrip() + "\n\n" if path.exists() else (
            "# Benchmark results\n\nEach row is ours ÷ a baseline measured in the same run. Newest first.\n\n")
        rest = path.read_text().split("\n## ", 1)[1] if path.exists() and "\n## " in path.read_text() else ""
        path.write_text(head + section + ("\n## " + rest if rest else ""))
        print(f"recorded in {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
