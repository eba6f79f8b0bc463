"""Pipeline parallel against one process, in float32: the same model, data and seed, three
AdamW steps through ``model.fsdp_turbo_pipeline.step``; losses rtol 2e-5 and the first
step's gradients of every stage (rtol 1e-4, atol 1e-6). And the plan's rules, checked before
anything runs. (Beside turbo-memory's recompute: integration_tests/test_integ_pipeline.py.)"""

import pytest
from pipeline_jobs import LR, batches, model_of, pipeline_records

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.testing import run_distributed
from fsdp_turbo.core.testing.parity import TrainRecord, assert_parity, train_steps
from fsdp_turbo.distributed.pipeline_parallel.schedules import check_microbatches, stages_per_rank
from fsdp_turbo.distributed.pipeline_parallel.stages import layer_bounds, plan_stages
from fsdp_turbo.fsdp_turbo import model_facts, plan_transforms
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

pytest.importorskip("transformers")

TP_SP = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
         "rowwise_parallel": ["*.o_proj", "*.down_proj"], "sequence_parallel": ["*layernorm", "model.norm"]}
TP_SP_LOSS_PARALLEL = {**TP_SP, "colwise_parallel": [*TP_SP["colwise_parallel"], "lm_head"],
                       "rowwise_parallel": [*TP_SP["rowwise_parallel"], "model.embed_tokens"], "loss_parallel": True}
TWO_RANKS = {
    "PP=2 1f1b": (4, {"pipeline_parallel_size": 2}),
    "PP=2 gpipe, 4 micro-batches": (4, {"pipeline_parallel_size": 2, "pipeline_schedule": "gpipe",
                                        "pipeline_microbatches": 4}),
    "PP=2 interleaved 1f1b": (4, {"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"}),
    "PP=2 zbv": (4, {"pipeline_parallel_size": 2, "pipeline_schedule": "zbv"}),
    "PP=2 interleaved 1f1b, 3 stages a rank, split unevenly": (
        8, {"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b", "pipeline_stages_per_rank": 3,
            "pipeline_split_points": [1, 3, 4, 6, 7], "pipeline_microbatches": 4}),
}
FOUR_RANKS = {
    "PP=2 x FSDP=2 1f1b": (4, {"pipeline_parallel_size": 2, "fully_shard_parallel_size": 2}),
    "PP=2 x FSDP=2 interleaved 1f1b": (4, {"pipeline_parallel_size": 2, "fully_shard_parallel_size": 2,
                                           "pipeline_schedule": "interleaved_1f1b"}),
    "PP=4 1f1b, 8 micro-batches": (8, {"pipeline_parallel_size": 4, "pipeline_microbatches": 8}),
    "PP=4 zbv": (8, {"pipeline_parallel_size": 4, "pipeline_schedule": "zbv"}),
    "PP=2 x FSDP=2 dualpipev": (4, {"pipeline_parallel_size": 2, "fully_shard_parallel_size": 2,
                                    "pipeline_schedule": "dualpipev"}),
    "PP=2 x DP=2 (replicated) zbv": (4, {"pipeline_parallel_size": 2, "data_parallel_size": 2,
                                         "pipeline_schedule": "zbv"}),
    "PP=2 x TP=2 with SP, gpipe": (4, {"pipeline_parallel_size": 2, "pipeline_schedule": "gpipe",
                                       "tensor_parallel_size": 2, "tp_plan": TP_SP}),
    "PP=2 x TP=2 with SP, loss parallel, sharded embedding and head, 1f1b": (
        4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": TP_SP_LOSS_PARALLEL}),
    "PP=2 x EP=2 on Qwen3-MoE": (4, {"pipeline_parallel_size": 2, "expert_parallel_size": 2,
                                     "ep_plan": {"apply_modules": ["*mlp.experts*"]}}, "qwen3_moe"),
    "PP=2 x CP=2 Ulysses": (4, {"pipeline_parallel_size": 2, "context_parallel_size": 2}),
    "PP=2 x CP=2 load-balanced ring, interleaved 1f1b": (
        4, {"pipeline_parallel_size": 2, "context_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b",
            "cp_plan": {"mode": "ring", "load_balance": True}}),
}


def reference(layers: int, kind: str = "llama") -> TrainRecord:
    return train_steps(model_of(layers, kind), batches(), lr=LR)


@pytest.mark.multirank
@pytest.mark.parametrize("world, layouts", [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2 ranks", "4 ranks"])
def test_pipeline_matches_one_process(world, layouts):
    per_rank = run_distributed(pipeline_records, world, layouts, timeout=600)
    references = {(layers, *kind): reference(layers, *kind) for layers, _, *kind in layouts.values()}
    for name, (layers, _, *kind) in layouts.items():
        merged = TrainRecord(losses=per_rank[0][name].losses,
                             grads={k: v for rank in per_rank for k, v in rank[name].grads.items()})
        for rank in per_rank:
            assert rank[name].losses == merged.losses, name
        assert_parity(references[(layers, *kind)], merged, loss_rtol=2e-5, grad_rtol=1e-4, grad_atol=1e-6)


def test_layers_split_evenly_or_at_declared_points():
    assert layer_bounds(8, 4, ()) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layer_bounds(5, 3, (1, 4)) == [(0, 1), (1, 4), (4, 5)]
    with pytest.raises(ConfigError, match="pipeline_stages_per_rank=3 is invalid: 8 layers do not split evenly"):
        layer_bounds(8, 3, ())
    with pytest.raises(ConfigError, match="give 3 split points for 4 stages"):
        layer_bounds(8, 4, (2, 4))
    with pytest.raises(ConfigError, match="a stage would hold no layer"):
        layer_bounds(4, 2, (4,))


def test_stages_go_to_ranks_looped_or_in_a_v():
    assert [s.rank for s in plan_stages(8, 4, 1, "loop", ())] == [0, 1, 2, 3]
    assert [s.rank for s in plan_stages(8, 2, 2, "loop", ())] == [0, 1, 0, 1]
    assert [s.rank for s in plan_stages(8, 2, 2, "v", ())] == [0, 1, 1, 0]


def test_schedule_rules():
    assert stages_per_rank("interleaved_1f1b", None) == 2 and stages_per_rank("interleaved_1f1b", 3) == 3
    with pytest.raises(ConfigError, match="pipeline_stages_per_rank=3 is invalid"):
        stages_per_rank("zbv", 3)
    with pytest.raises(ConfigError, match="pipeline_stages_per_rank=1 is invalid"):
        stages_per_rank("interleaved_1f1b", 1)
    with pytest.raises(ConfigError, match=r"microbatches=2 is invalid: .* needs a micro-batch for every stage"):
        check_microbatches("1f1b", 2, 4, 4)
    with pytest.raises(ConfigError, match="pipeline_microbatches=5 is invalid"):
        check_microbatches("interleaved_1f1b", 5, 4, 2)
    check_microbatches("gpipe", 1, 4, 4)


def _plan(layers=4, world=4, **fields):
    config = FSDPTurboConfig.from_dict(fields)
    model = model_of(layers)
    state = ParallelState(config.validate(world), rank=0, device_type="cpu", distributed=True)
    return plan_transforms(config, model, state, facts=model_facts(config, model))


@pytest.mark.parametrize("fields, message", [
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 is invalid: .*each pipeline stage needs the same"),
    ({"pipeline_parallel_size": 4, "pipeline_schedule": "interleaved_1f1b"},
     "pipeline_stages_per_rank=8 is invalid: 4 layers do not split evenly into 8 stages"),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "zbv", "fsdp_plan": {"reshard_after_forward": True}},
     "fsdp_plan.reshard_after_forward=True is invalid: .*'zbv' computes weight gradients in a pass of its own"),
    ({"pipeline_parallel_size": 2, "router_bias_update_rate": 0.001},
     "router_bias_update_rate=0.001 is invalid: .*once per micro-batch"),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "zero_bubble"}, "pipeline_schedule='zero_bubble' is invalid"),
    ({"pipeline_parallel_size": 2, "pipeline_split_points": [3, 1]}, "pipeline_split_points=.* is invalid"),
])
def test_bad_pipeline_configs_are_refused_before_anything_runs(fields, message):
    with pytest.raises(ConfigError, match=message):
        _plan(**fields)


def test_tied_embeddings_are_refused():
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    config = FSDPTurboConfig.from_dict({"pipeline_parallel_size": 2})
    model = tiny_hf_causal_lm("llama", num_hidden_layers=4, tie_word_embeddings=True)
    state = ParallelState(config.validate(2), rank=0, device_type="cpu", distributed=True)
    with pytest.raises(ConfigError, match="tie_word_embeddings=True is invalid"):
        plan_transforms(config, model, state, facts=model_facts(config, model))


def test_the_plan_names_each_stages_modules():
    plans = dict(_plan(layers=4, world=4, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b"))
    plan = next(p for t, p in plans.items() if t.name == "pipeline_parallel")
    rows = {row.label: row.names for row in plan.describe()}
    assert rows == {
        "pipeline stage 0 (pp rank 0, interleaved_1f1b, 4 micro-batches)": ("model.embed_tokens", "model.layers.0"),
        "pipeline stage 1 (pp rank 1, interleaved_1f1b, 4 micro-batches)": ("model.layers.1",),
        "pipeline stage 2 (pp rank 0, interleaved_1f1b, 4 micro-batches)": ("model.layers.2",),
        "pipeline stage 3 (pp rank 1, interleaved_1f1b, 4 micro-batches)": ("model.layers.3", "model.norm",
                                                                              "lm_head"),
    }
