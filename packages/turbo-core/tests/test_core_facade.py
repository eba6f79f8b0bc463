"""The facade in one process: it returns the user's model unchanged in behaviour,
and names the package to install for a missing feature."""

import pytest
import torch

from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import TransformRegistry
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo, plan_transforms
from fsdp_turbo.fsdp_turbo_config import ConfigError, FSDPTurboConfig

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_single_process_returns_the_same_model():
    plain = tiny_hf_causal_lm("llama", seed=3)
    model = tiny_hf_causal_lm("llama", seed=3)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    wrapped = FSDPTurbo(FSDPTurboConfig(), model)
    assert wrapped is model
    assert list(wrapped.state_dict()) == keys
    assert [n for n, _ in wrapped.named_parameters()] == names
    assert wrapped.config.hidden_size == 64
    state = wrapped.parallel_state
    assert (state.world_size, state.dp_rank, state.dp_size, state.tp_size, state.distributed) == (1, 0, 1, 1, False)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(wrapped(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss,
                               rtol=0, atol=0)


def test_applying_twice_is_a_config_error():
    model = FSDPTurbo(FSDPTurboConfig(), tiny_hf_causal_lm("llama"))
    with pytest.raises(ConfigError, match="already been through FSDPTurbo"):
        FSDPTurbo(FSDPTurboConfig(), model)


def test_config_from_dict_and_file(tmp_path):
    path = tmp_path / "turbo.yaml"
    path.write_text("fully_shard_parallel_size: 1\n")
    assert FSDPTurbo(str(path), tiny_hf_causal_lm("llama")).fsdp_turbo_config.fully_shard_parallel_size == 1
    assert FSDPTurbo({"fully_shard_parallel_size": -1}, tiny_hf_causal_lm("llama")).parallel_state.dp_size == 1


def test_sizes_beyond_a_single_process_are_a_config_error():
    with pytest.raises(ConfigError) as info:
        FSDPTurbo(FSDPTurboConfig(fully_shard_parallel_size=4), tiny_hf_causal_lm("llama"))
    assert info.value.field == "fully_shard_parallel_size"
    assert "world size is 1" in str(info.value)


def _state(config, world):
    return ParallelState(config.validate(world), 0, "cpu", distributed=False)


EMPTY = TransformRegistry(load_entry_points=False)


def test_missing_feature_package_is_named():
    config = FSDPTurboConfig(fully_shard_parallel_size=4)
    with pytest.raises(ConfigError) as info:
        plan_transforms(config, tiny_hf_causal_lm("llama"), _state(config, 4), EMPTY)
    assert "turbo-distributed" in str(info.value)
    config = FSDPTurboConfig(recompute=True)
    with pytest.raises(ConfigError, match="turbo-memory"):
        plan_transforms(config, tiny_hf_causal_lm("llama"), _state(config, 1), EMPTY)


# One non-default value for every field a feature owns (core.features.FEATURE_FIELDS).
OFF_FEATURE_VALUES = {
    "tp_plan": {"colwise_parallel": ["*.q_proj"], "sequence_parallel": ["*norm"], "loss_parallel": True},
    "ep_plan": {"dispatcher": "eager"},
    "expert_fully_shard_parallel_size": 1,
    "cp_plan": {"mode": "ring"},
    "recompute_plan": ["model.layers.*"],
    "recompute_policy": "selective",
    "chunk_loss_plan": {"chunk_size": 8},
    "chunk_batch_plan": {"num_chunks": 4},
    "swap_activation_plan": ["model.layers.*"],
    "swap_force": True,
    "compile_plan": ["model.layers.*"],
    "compile_backend": "aot_eager",
    "pipeline_schedule": "gpipe",
    "pipeline_microbatches": 4,
    "pipeline_stages_per_rank": 2,
    "pipeline_split_points": [1],
}


def test_every_field_a_feature_owns_is_covered():
    from fsdp_turbo.core.features import FEATURE_FIELDS

    assert {f for fields in FEATURE_FIELDS.values() for f in fields} == set(OFF_FEATURE_VALUES)


@pytest.mark.parametrize("field", list(OFF_FEATURE_VALUES))
def test_a_plan_for_a_feature_that_is_off_is_named_in_one_warning(field, caplog):
    """One rule for every such field: the model is built as if it were absent, and one
    rank-0 warning names it (so one config serves jobs of several sizes)."""
    import logging

    plain = tiny_hf_causal_lm("llama", seed=3)
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        model = FSDPTurbo({field: OFF_FEATURE_VALUES[field]}, tiny_hf_causal_lm("llama", seed=3))
    warnings = [r.getMessage() for r in caplog.records if "features are off" in r.getMessage()]
    assert len(warnings) == 1 and f"{field} (" in warnings[0]
    assert list(model.fsdp_turbo_plans) == []  # nothing applied
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss,
                               rtol=0, atol=0)
