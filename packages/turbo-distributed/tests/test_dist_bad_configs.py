"""Bad input: every rank raises the same ConfigError, before any collective, with no hang."""

import pytest

from fsdp_turbo.core.testing import run_distributed
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

WORLD = 4
CASES = {
    "fsdp_does_not_divide_world": ({"fully_shard_parallel_size": 3}, "fully_shard_parallel_size"),
    "sizes_exceed_world": ({"data_parallel_size": 2, "fully_shard_parallel_size": 4}, "fully_shard_parallel_size"),
    "dp_does_not_divide_world": ({"data_parallel_size": 3},
                                 "data_parallel_size*context_parallel_size*tensor_parallel_size"),
    "fsdp_pattern_matches_nothing": ({"fsdp_plan": {"apply_modules": ["*.nothing"]}}, "fsdp_plan.apply_modules"),
    "ignored_pattern_matches_nothing": ({"fsdp_plan": {"ignored_modules": ["*.nothing"]}},
                                        "fsdp_plan.ignored_modules"),
    "ignored_module_contains_a_unit": ({"fsdp_plan": {"ignored_modules": ["model.layers.{0-0}"]}},
                                       "fsdp_plan.ignored_modules"),
    "unknown_dtype": ({"fsdp_plan": {"param_dtype": "bfloat17"}}, "fsdp_plan.param_dtype"),
    "negative_prefetch": ({"fsdp_plan": {"num_to_backward_prefetch": -1}}, "fsdp_plan.num_to_backward_prefetch"),
    "tp_without_plan": ({"tensor_parallel_size": 2}, "tp_plan"),
    "heads_not_divisible_by_tp": ({"tensor_parallel_size": 4, "tp_plan": {"colwise_parallel": ["*.q_proj"]}},
                                  "tensor_parallel_size"),
    "heads_not_divisible_by_cp": ({"context_parallel_size": 4}, "tensor_parallel_size*context_parallel_size"),
    "cp_attention_function_does_not_import": ({"context_parallel_size": 2,
                                               "model_facts": {"attention_function": "no_such_package.attention"}},
                                              "model_facts.attention_function"),
    "cp_attention_function_not_a_path": ({"context_parallel_size": 2, "model_facts": {"attention_function": "sdpa"}},
                                         "model_facts.attention_function"),
    "head_module_not_a_module": ({"tensor_parallel_size": 2, "model_facts": {"head_module": "output"}, "tp_plan": {
        "colwise_parallel": ["*.q_proj"], "sequence_parallel": ["*layernorm"]}},
        "model_facts.head_module"),
    "cp_unknown_mode": ({"context_parallel_size": 2, "cp_plan": {"mode": "spiral"}}, "cp_plan.mode"),
    "cp_hybrid_ulysses_size_not_a_divisor": ({"context_parallel_size": 4,
                                              "cp_plan": {"mode": "hybrid", "ulysses_size": 3}},
                                             "cp_plan.ulysses_size"),
    "cp_hybrid_without_ulysses_size": ({"context_parallel_size": 4, "cp_plan": {"mode": "hybrid"}},
                                       "cp_plan.ulysses_size"),
    "cp_kv_allgather_ulysses_size_the_whole_group": ({"context_parallel_size": 4, "cp_plan": {
        "mode": "kv_allgather", "ulysses_size": 4}}, "cp_plan.ulysses_size"),
    "cp_ring_with_ulysses_size": ({"context_parallel_size": 4, "cp_plan": {"mode": "ring", "ulysses_size": 2}},
                                  "cp_plan.ulysses_size"),
    "cp_block_size_zero": ({"context_parallel_size": 2, "cp_plan": {"mode": "ring", "block_size": 0}},
                           "cp_plan.block_size"),
    "cp_attention_modules_match_nothing": ({"context_parallel_size": 2, "model_facts": {
        "attention_modules": ["layers.*.inner_attention"]}}, "model_facts.attention_modules"),
    "cp_token_input_not_a_name": ({"context_parallel_size": 2, "model_facts": {"token_input": "tokens[0]"}},
                                  "model_facts.token_input"),
    "ep_does_not_divide_world": ({"expert_parallel_size": 3, "ep_plan": {}}, "expert_parallel_size"),
    "unknown_dispatcher": ({"expert_parallel_size": 2, "ep_plan": {"dispatcher": "allgather"}},
                           "ep_plan.dispatcher"),
    "unknown_field": ({"fully_shard_parallel_sise": 4}, "fully_shard_parallel_sise"),
    "tp_pattern_matches_non_linear": ({"tensor_parallel_size": 2,
                                       "tp_plan": {"colwise_parallel": ["model.layers.*.mlp"]}},
                                      "tp_plan.colwise_parallel"),
    "module_in_two_tp_plans": ({"tensor_parallel_size": 2,
                                "tp_plan": {"colwise_parallel": ["*.q_proj"], "rowwise_parallel": ["*_proj"]}},
                               "tp_plan.rowwise_parallel"),
    "tp_pattern_matches_nothing": ({"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["*.wq"]}},
                                   "tp_plan.colwise_parallel"),
    "loss_parallel_head_not_colwise": ({"tensor_parallel_size": 2,
                                        "tp_plan": {"colwise_parallel": ["*.q_proj"], "loss_parallel": True}},
                                       "tp_plan.loss_parallel"),
    # the final norm, after the blocks, left out (a norm inside the blocks left out runs on each
    # rank's tokens with its gradient summed)
    "sequence_parallel_misses_norms": ({"tensor_parallel_size": 2, "tp_plan": {
        "colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"], "rowwise_parallel": ["*.o_proj"],
        "sequence_parallel": ["*layernorm"]}}, "tp_plan.sequence_parallel"),
    # q split by head and k, v, o left whole beside it: not per head
    "attention_half_split": ({"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["*.q_proj"]}},
                             "tp_plan.colwise_parallel"),
}
EP = {"expert_parallel_size": 2}
# Expert-parallel cases on a tiny Qwen3-MoE (8 experts): (config, field, model overrides).
MOE_CASES = {
    "experts_not_divisible_by_ep": ({"expert_parallel_size": 4, "ep_plan": {}}, "expert_parallel_size",
                                    {"num_experts": 6}),
    "ep_pattern_matches_nothing": ({**EP, "ep_plan": {"apply_modules": ["*.moe.experts"]}},
                                   "ep_plan.apply_modules", None),
    "ep_pattern_matches_a_router": ({**EP, "ep_plan": {"apply_modules": ["*mlp.gate"]}},
                                    "ep_plan.apply_modules", None),
    "ep_pattern_matches_a_dense_mlp": ({**EP, "ep_plan": {"apply_modules": ["model.layers.*.mlp"]}},
                                       "ep_plan.apply_modules", None),
    "ep_with_tp_but_no_sequence_parallel": ({**EP, "ep_plan": {}, "tensor_parallel_size": 2,
                                             "tp_plan": {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"],
                                                         "rowwise_parallel": ["*.o_proj"]}},
                                            "tp_plan.sequence_parallel", None),
    "efsdp_does_not_divide_world": ({**EP, "ep_plan": {}, "expert_fully_shard_parallel_size": 3},
                                    "expert_fully_shard_parallel_size", None),
}
# Cases that need a particular model shape: (config, field, model overrides).
MODEL_CASES = {
    "kv_heads_not_divisible_by_tp": ({"tensor_parallel_size": 4, "tp_plan": {"colwise_parallel": ["*.q_proj"]}},
                                     "tensor_parallel_size", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "colwise_dim_not_divisible_by_tp": ({"tensor_parallel_size": 4, "tp_plan": {"colwise_parallel": ["lm_head"]}},
                                        "tp_plan.colwise_parallel",
                                        {"num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 250}),
    "cp_ring_on_flex_attention": ({"context_parallel_size": 4, "cp_plan": {"mode": "ring"}}, "cp_plan.mode",
                                  {"attn_implementation": "flex_attention"}),
    "cp_ring_with_attention_dropout": ({"context_parallel_size": 4, "cp_plan": {"mode": "ring"}}, "cp_plan.mode",
                                       {"attention_dropout": 0.1}),
    "tied_weights_sharded_differently": ({"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["lm_head"]}},
                                         "tp_plan", {"tie_word_embeddings": True}),
}


def build_with_bad_config(config, model_kwargs=None, kind="llama"):
    import torch.distributed as dist

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    default = {"num_attention_heads": 6, "hidden_size": 96} if kind == "llama" else {}
    model = tiny_hf_causal_lm(kind, **(model_kwargs or default))
    groups_before = len(dist.distributed_c10d._world.pg_map)
    try:
        FSDPTurbo(config, model)
    except Exception as error:
        # No collective ran: no process group (mesh) was created before the error.
        return error, len(dist.distributed_c10d._world.pg_map) - groups_before
    return None, len(dist.distributed_c10d._world.pg_map) - groups_before


ALL_CASES = {**{k: (*v, None, "llama") for k, v in CASES.items()},
             **{k: (*v, "llama") for k, v in MODEL_CASES.items()},
             **{k: (*v, "qwen3_moe") for k, v in MOE_CASES.items()}}


@pytest.mark.parametrize("case", list(ALL_CASES))
def test_bad_config_raises_same_error_on_every_rank(case):
    from fsdp_turbo.fsdp_turbo_config import ConfigError

    config, field, model_kwargs, kind = ALL_CASES[case]
    results = run_distributed(build_with_bad_config, WORLD, config, model_kwargs, kind, timeout=120)
    errors = [error for error, _ in results]
    assert all(isinstance(e, ConfigError) for e in errors), errors
    assert {e.field for e in errors} == {field}
    assert len({str(e) for e in errors}) == 1
    assert [new_groups for _, new_groups in results] == [0] * WORLD


def test_a_good_config_does_build_meshes():
    # The counter above is meaningful: a valid config creates the FSDP mesh's groups.
    results = run_distributed(build_with_bad_config, WORLD, {"fully_shard_parallel_size": 4}, timeout=120)
    assert [error for error, _ in results] == [None] * WORLD
    assert all(new_groups > 0 for _, new_groups in results)
