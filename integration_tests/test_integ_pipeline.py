"""Pipeline parallel beside the other packages' features, against one process in float32
(three AdamW steps; losses rtol 2e-5, first-step gradients of every stage rtol 1e-4 / atol
1e-6): PP=2 x FSDP=2 with full and selective recompute of every layer (turbo-memory)."""

import pytest

from fsdp_turbo.core.testing import run_distributed
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import (
    TrainRecord,
    assert_parity,
    make_token_batches,
    seed_everything,
    train_pipeline_steps,
    train_steps,
)

pytest.importorskip("transformers")
LAYOUTS = {
    "PP=2 x FSDP=2 1f1b + full recompute": {"pipeline_parallel_size": 2, "fully_shard_parallel_size": 2,
                                            "recompute": True},
    "PP=2 x FSDP=2 interleaved 1f1b + selective recompute": {
        "pipeline_parallel_size": 2, "fully_shard_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b",
        "recompute": True, "recompute_policy": "selective"},
}


def _model():
    return tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=4, tie_word_embeddings=False)


def _batches():
    return make_token_batches(vocab_size=256, global_batch=8, seq_len=16, steps=3)


def _records(layouts: dict[str, dict]) -> dict[str, TrainRecord]:
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    records = {}
    for name, config in layouts.items():
        seed_everything(0)
        records[name] = train_pipeline_steps(FSDPTurbo(config, _model()), _batches())
    return records


@pytest.mark.multirank
def test_pipeline_with_recompute_matches_one_process():
    per_rank = run_distributed(_records, 4, LAYOUTS, timeout=600)
    reference = train_steps(_model(), _batches())
    for name in LAYOUTS:
        merged = TrainRecord(losses=per_rank[0][name].losses,
                             grads={k: v for rank in per_rank for k, v in rank[name].grads.items()})
        assert_parity(reference, merged, loss_rtol=2e-5, grad_rtol=1e-4, grad_atol=1e-6)
