"""The data pipeline's two costs: preparing a corpus, and feeding the training loop.

1. **Tokenization throughput.** A text corpus (this Python's standard library, one jsonl
   row per file, about 8 MB) with the SFT example's BPE tokenizer. Ours: ``prepare_source``
   from the jsonl file to the cache (read with ``datasets``, tokenized, written as Arrow,
   packed into windows). Baseline, in the same run: one plain batched call of the same HF
   tokenizer, ``tokenizer(texts)``, on the texts already in memory (what a script without a
   pipeline does). Ratio: our tokens/s / baseline tokens/s; goal >= 1.0.
2. **Data wait.** The SFT example (``examples/sft_tiny.yaml``: the demo-size model on 4
   ranks) for ``--steps`` steps; each step's metrics row holds the seconds spent fetching
   its batches (``data_wait_s``) and the whole step (``step_s``). Ratio: their sums over
   the steps after the first five; goal <= 0.02.

    python tools/bench/data_pipeline.py [--steps 40] [--megabytes 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from report import result

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "sft_tiny" / "tokenizer"


def corpus(path: Path, megabytes: float) -> int:
    total = 0
    with path.open("w", encoding="utf-8") as handle:
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            handle.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode("utf-8"))
            if total >= megabytes * 2**20:
                break
    return total


def tokenization(megabytes: float) -> None:
    from fsdp_turbo.cli.data.prepare import SourceSpec, prepare_source
    from fsdp_turbo.cli.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "corpus.jsonl"
        size = corpus(path, megabytes)
        tokenizer = load_tokenizer(str(TOKENIZER))
        texts = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
        started = time.perf_counter()
        plain = tokenizer.hf(texts)["input_ids"]
        base_seconds = time.perf_counter() - started
        tokens = sum(len(ids) for ids in plain)
        del plain
        spec = SourceSpec("data.sources[0]", (str(path),), "text", None)
        started = time.perf_counter()
        prepared = prepare_source(spec, tokenizer, seq_len=2048, packing=True, overflow="split",
                                  cache_dir=Path(folder) / "cache")
        ours_seconds = time.perf_counter() - started
        ours_tokens = prepared.stats["tokens"] - len(texts)  # ours adds an EOS token per document
    ours, base = ours_tokens / ours_seconds, tokens / base_seconds
    print(f"corpus {size / 2**20:.1f} MiB, {len(texts)} documents, {tokens:,} tokens; "
          f"ours {ours:,.0f} tokens/s ({ours_seconds:.2f} s, to a packed cache), "
          f"plain tokenizer(texts) {base:,.0f} tokens/s ({base_seconds:.2f} s)")
    result("prepare_source tokens/s / plain batched tokenizer(texts)", ours / base, ">= 1.0",
           f"{size / 2**20:.1f} MiB, {tokens:,} tokens, {os.cpu_count()} cores")


def data_wait(steps: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "fsdp_turbo.cli.main", "train", "examples/sft_tiny.yaml",
                   "--nproc-per-node", "4", "--max-steps", str(steps), "--output-dir", folder, "--resume", "none",
                   "--save-every", str(10 * steps)]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
        from fsdp_turbo.cli.metrics import read_rows

        rows = read_rows(Path(folder) / "metrics.jsonl")[5:]
    waited, total = sum(r["data_wait_s"] for r in rows), sum(r["step_s"] for r in rows)
    print(f"SFT example, {len(rows)} steps measured: data wait {waited * 1e3:.1f} ms of {total:.2f} s of steps")
    result("data wait / step time (SFT example, 4 ranks)", waited / total, "<= 0.02",
           f"{waited / len(rows) * 1e3:.2f} ms of {total / len(rows) * 1e3:.0f} ms a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--megabytes", type=float, default=8.0)
    options = parser.parse_args()
    tokenization(options.megabytes)
    data_wait(options.steps)


if __name__ == "__main__":
    main()
