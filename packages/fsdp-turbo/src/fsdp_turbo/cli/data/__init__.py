"""The ``fsdp-turbo`` data pipeline: a job's ``data`` section to training and eval batches.

    tokenizer.py  byte or a local HF tokenizer
    sources.py    files -> a datasets table (jsonl, json, parquet, csv, txt, arrow, save_to_disk)
    chat.py       SFT: the chat template and the assistant-only labels
    packing.py    document lengths -> seq_len windows
    prepare.py    tokenize + pack once per (tokenizer, files, settings), cached, one process at a time;
                  each source's data identity (what a resume checks)
    mixture.py    the seeded, weighted, resumable order of windows
    loader.py     windows -> batches; the loader state
    show.py       ``fsdp-turbo data``: the first sequences, decoded, and statistics
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fsdp_turbo.cli.data.loader import Batch, EvalSet, TrainStream
from fsdp_turbo.cli.data.prepare import PreparedSource, SourceSpec, prepare_source
from fsdp_turbo.cli.data.tokenizer import load_tokenizer
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import IGNORE_INDEX

__all__ = ["Batch", "EvalSet", "JobData", "TrainStream", "load_data"]


@dataclass
class JobData:
    tokenizer: object
    train: TrainStream
    eval: EvalSet | None
    train_sources: list[PreparedSource]
    eval_sources: list[PreparedSource]


def _specs(sources, field: str) -> list[SourceSpec]:
    return [SourceSpec(f"{field}[{i}]", (s.path,), s.text_field, s.messages_field) for i, s in enumerate(sources)]


def check_vocab(tokenizer, vocab_size: int | None) -> None:
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ConfigError("data.tokenizer", str(getattr(tokenizer, "folder", "byte")),
                          f"use a model with vocab_size >= {tokenizer.vocab_size}, or another tokenizer",
                          reason=f"it has {tokenizer.vocab_size} tokens and the model's vocab_size is {vocab_size}")


def load_data(data, output_dir: str | Path, seed: int, vocab_size: int | None = None,
              ignore_index: int = IGNORE_INDEX) -> JobData:
    """Every rank calls this before any process group; see ``prepare`` for who does the work.
    ``ignore_index``: the label of the tokens that carry no loss (the job's
    ``turbo.model_facts.ignore_index``)."""
    tokenizer = load_tokenizer(data.tokenizer)
    check_vocab(tokenizer, vocab_size)
    cache = Path(data.cache_dir) if data.cache_dir else Path(output_dir) / "data_cache"
    settings = {"seq_len": data.seq_len, "packing": data.packing, "overflow": data.overflow, "cache_dir": cache,
                "lock_timeout_s": data.cache_lock_timeout_s, "ignore_index": ignore_index}
    if data.sources is None:  # the shorthand: all the files are one text source
        train_specs, weights = [SourceSpec("data.files", data.files, "text", None, data.max_bytes)], [1.0]
    else:
        train_specs, weights = _specs(data.sources, "data.sources"), [s.weight for s in data.sources]
    train = [prepare_source(spec, tokenizer, **settings) for spec in train_specs]
    evaluated = [prepare_source(spec, tokenizer, **settings)
                 for spec in _specs(data.eval.sources, "data.eval.sources")] if data.eval else []
    common = {"seq_len": data.seq_len, "packing": data.packing, "pad_id": tokenizer.pad_id,
              "ignore_index": ignore_index}
    stream = TrainStream(train, weights, seed=seed, **common)
    held_out = EvalSet(evaluated, **common) if evaluated else None
    return JobData(tokenizer, stream, held_out, train, evaluated)
