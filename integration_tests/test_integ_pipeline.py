"""Pipeline parallel beside the other packages' features, against one process in float32
(three AdamW steps; losses rtol 2e-5, first-step gradients of every stage rtol 1e-4 / atol
1e-6): recompute (full, selective), the chunked loss, chunk_batch, both swaps, compile
(turbo-memory, turbo-core) and MXFP8 training (turbo-quant, whose one-process reference is
the same MXFP8 model)."""

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
PP2_FSDP2 = {"pipeline_parallel_size": 2, "fully_shard_parallel_size": 2}
MXFP8 = {"quantization_plan": {"quant_format": "E4M3", "block_size": 32}}
LAYOUTS = {
    "PP=2 x FSDP=2 1f1b + full recompute": {**PP2_FSDP2, "recompute": True},
    "PP=2 x FSDP=2 interleaved 1f1b + selective recompute": {
        **PP2_FSDP2, "pipeline_schedule": "interleaved_1f1b", "recompute": True, "recompute_policy": "selective"},
    "PP=2 x FSDP=2 zbv + chunked loss (12-token chunks)": {
        **PP2_FSDP2, "pipeline_schedule": "zbv", "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 12}},
    "PP=2 x FSDP=2 1f1b + chunk_batch + both swaps (forced on CPU)": {
        **PP2_FSDP2, "chunk_batch": True, "swap_activation": True, "swap_optimizer": True, "swap_force": True},
    "PP=2 x FSDP=2 interleaved 1f1b + compile": {**PP2_FSDP2, "pipeline_schedule": "interleaved_1f1b",
                                                "compile": True},
    "PP=2 x FSDP=2 1f1b + MXFP8": {**PP2_FSDP2, **MXFP8},
}
REFERENCES = {"PP=2 x FSDP=2 1f1b + MXFP8": MXFP8}  # else the plain model


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


def _reference(config: dict | None) -> TrainRecord:
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    seed_everything(0)
    model = _model() if config is None else FSDPTurbo(config, _model())
    return train_steps(model, _batches())


@pytest.mark.multirank
def test_pipeline_beside_the_other_packages_features_matches_one_process():
    per_rank = run_distributed(_records, 4, LAYOUTS, timeout=600)
    plain = _reference(None)
    for name in LAYOUTS:
        merged = TrainRecord(losses=per_rank[0][name].losses,
                             grads={k: v for rank in per_rank for k, v in rank[name].grads.items()})
        reference = _reference(REFERENCES[name]) if name in REFERENCES else plain
        assert_parity(reference, merged, loss_rtol=2e-5, grad_rtol=1e-4, grad_atol=1e-6)


def test_a_peft_model_is_refused_by_name():
    """Splitting a PEFT model into stages is not verified: refused before anything runs."""
    from peft import LoraConfig, get_peft_model

    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo import model_facts, plan_transforms
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    config = FSDPTurboConfig.from_dict({"pipeline_parallel_size": 2})
    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj"]))
    state = ParallelState(config.validate(2), rank=0, device_type="cpu", distributed=True)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 is invalid: splitting a PEFT model"):
        plan_transforms(config, model, state, facts=model_facts(config, model))
