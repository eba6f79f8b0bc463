"""Rank functions of the pipeline-parallel parity tests."""

from __future__ import annotations

import torch

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import TrainRecord, make_token_batches, seed_everything, train_pipeline_steps

VOCAB = 256
GLOBAL_BATCH = 8
SEQ = 16
STEPS = 3
LR = 1e-2


def model_of(layers: int, kind: str = "llama"):
    return tiny_hf_causal_lm(kind, seed=0, num_hidden_layers=layers, vocab_size=VOCAB, tie_word_embeddings=False)


def batches() -> list[torch.Tensor]:
    return make_token_batches(vocab_size=VOCAB, global_batch=GLOBAL_BATCH, seq_len=SEQ, steps=STEPS)


def pipeline_records(layouts: dict[str, tuple]) -> dict[str, TrainRecord]:
    """Each layout (decoder layers, FSDPTurbo config[, model kind]) trained for ``STEPS`` AdamW steps through
    ``model.fsdp_turbo_pipeline.step``."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    records = {}
    for name, (layers, config, *kind) in layouts.items():
        seed_everything(0)
        records[name] = train_pipeline_steps(FSDPTurbo(config, model_of(layers, *kind)), batches(), lr=LR)
    return records
