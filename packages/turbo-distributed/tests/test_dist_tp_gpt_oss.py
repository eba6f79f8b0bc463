"""gpt-oss (attention sinks, sliding-window layers) under tensor parallel: the per-head
sinks split with their heads; a per-head parameter the planner does not know is refused at
plan time. Context parallel plans the sliding-window layers (each must pass its window on
the first forward; its parity is in integration_tests/test_integ_families.py).

Parity: FSDP=2 x TP=2 with sequence parallel, 4 AdamW steps in float32 against one process
(losses rtol 1e-5, first-step gradients rtol 1e-4 / atol 1e-6)."""

import pytest
import torch
from distributed_jobs import BATCHES, TOLERANCES, facade_run, reference_run
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.context_parallel.context import CPState, LayerSpec
from fsdp_turbo.distributed.context_parallel.transform import plan_context_parallel
from fsdp_turbo.distributed.tensor_parallel import StyleChoice, StyleKind, resolve_tp_plan
from fsdp_turbo.fsdp_turbo_config import CPPlanConfig, TPPlanConfig

pytest.importorskip("transformers")

ATTENTION = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"], "rowwise_parallel": ["*.o_proj"],
             "sequence_parallel": ["*layernorm", "model.norm"]}


def _resolve(model, tp=2):
    return resolve_tp_plan(model, TPPlanConfig(**ATTENTION), tp, resolve_model_facts(model))


def test_gpt_oss_sinks_split_with_their_heads():
    plan = _resolve(tiny_hf_causal_lm("gpt_oss"))  # 4 query heads, 2 key/value heads
    attention = dict(plan.styles)["model.layers.1.self_attn"]
    assert attention.kind == "prepare_input" and attention.head_parameters == (("sinks", 0),)
    assert plan.local_shape("model.layers.1.self_attn.sinks", (4,)) == (2,)
    assert ("tp_plan (split with the heads)", ("model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks")) \
        in [(row.label, row.names) for row in plan.describe()]


@pytest.mark.parametrize("shape,kind", [((4,), "per-head parameter"), ((3,), "parameter it holds itself")])
def test_a_parameter_the_planner_does_not_know_is_refused_at_plan_time(shape, kind):
    """Llama's attention with a parameter of its own (as gpt-oss's sinks, but unregistered):
    a ConfigError naming it, not a shape error in the forward."""
    model = tiny_hf_causal_lm("llama")
    model.model.layers[1].self_attn.head_gate = nn.Parameter(torch.zeros(shape))
    with pytest.raises(ConfigError, match=r"model_facts\.head_parameters") as caught:
        _resolve(model)
    assert caught.value.field == "tp_plan.colwise_parallel"
    assert caught.value.value == "model.layers.1.self_attn.head_gate"
    assert kind in caught.value.reason and "LlamaAttention" in caught.value.reason


def test_a_known_per_head_parameter_must_split_evenly():
    # The heads split over tp=4 (8 query, 4 key/value); a sinks parameter of 6 does not.
    model = tiny_hf_causal_lm("gpt_oss", num_attention_heads=8, num_key_value_heads=4)
    model.model.layers[0].self_attn.sinks = nn.Parameter(torch.zeros(6))
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.sinks \(attention sinks\) has 6 heads"):
        _resolve(model, tp=4)


def test_context_parallel_plans_the_sliding_window_layers():
    model = tiny_hf_causal_lm("gpt_oss")
    for mode in ("ulysses", "ring", "kv_allgather"):
        plan = plan_context_parallel(model, CPPlanConfig(mode=mode), 2, resolve_model_facts(model))
        assert plan.sliding_layers == (0,)
        rows = {row.label: row.names for row in plan.describe()}
        skipped = ", unseen tiles skipped, cut ones computed in blocks of 64 query rows" if mode != "ulysses" else ""
        assert rows["cp_plan (sliding window)"] == (f"layers [0]: masked by their window{skipped}",)
    rows = {row.label: row.names for row in plan.describe()}
    assert rows["cp_plan (attention)"] == (
        "K/V all-gathered over 2 ranks (zig-zag chunks) on HF attention 'eager' calls",)
    assert rows["cp_plan (causal)"] == ("layers [1]: K/V all-gathered",)


def test_the_windows_and_sinks_come_from_the_model_facts():
    """The wrapper reads each attention module's window and per-head tensors from the plan (by
    the module HF passes it), not from the call: an attention that dropped its window would
    otherwise attend over the whole sequence under CP."""
    model = tiny_hf_causal_lm("gpt_oss")
    plan = plan_context_parallel(model, CPPlanConfig(), 2, resolve_model_facts(model))
    specs = {spec.name: (spec.window, spec.chunk, spec.head_parameters) for spec in plan.layers}
    assert specs == {"model.layers.0.self_attn": (8, None, ("sinks",)),
                     "model.layers.1.self_attn": (None, None, ("sinks",))}
    state = CPState(None, 2, 0, layers={model.get_submodule(spec.name): spec for spec in plan.layers})
    assert state.spec(model.model.layers[0].self_attn).window == 8
    assert state.spec(model.model.layers[0].mlp) == LayerSpec("")


@pytest.mark.multirank
def test_gpt_oss_fsdp2_x_tp2_with_sequence_parallel():
    """q/k/v colwise, o_proj rowwise, the norms sequence-parallel; the router and the biased
    experts run replicated on each rank's tokens; the sinks split with the heads."""
    config = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": ATTENTION}
    expected = run_reference(reference_run, "gpt_oss", BATCHES, timeout=300)
    results = run_distributed(facade_run, 4, "gpt_oss", BATCHES, config, None, None, True, timeout=300)
    for record, facts in results:
        assert_parity(expected, record, **TOLERANCES)
        assert facts["dtensor"]["model.layers.0.self_attn.sinks"]
        assert "Shard(dim=0)" in facts["placements"]["model.layers.0.self_attn.sinks"]


def test_mla_latent_modules_stay_whole_beside_the_split_heads():
    """DeepSeek-V3's MLA: q_b_proj / kv_b_proj split by head; q_a_proj and kv_a_proj_with_mqa read
    the prepared input whole and stay whole, the latent norms too (their gradients arrive whole
    through the split projections' summed input gradients); the rotary key, kv_a_proj_with_mqa's
    last qk_rope_head_dim outputs, feeds every head directly, so its gradient is summed over TP.
    Parity: integration_tests/test_integ_families.py (FSDP=2 x TP=2 with sequence parallel)."""
    model = tiny_hf_causal_lm("deepseek_v3")
    plan = TPPlanConfig(colwise_parallel=["*.q_b_proj", "*.kv_b_proj"], rowwise_parallel=["*.o_proj"])
    styles = dict(resolve_tp_plan(model, plan, 2, resolve_model_facts(model)).styles)
    attention = "model.layers.0.self_attn"
    rope = model.config.qk_rope_head_dim
    assert styles[f"{attention}.q_a_proj"] == StyleChoice(StyleKind.REPLICATE_PREPARED)
    assert styles[f"{attention}.kv_a_proj_with_mqa"] == StyleChoice(StyleKind.REPLICATE_PREPARED, shared_tail=rope)
    assert styles[f"{attention}.q_a_layernorm"] == styles[f"{attention}.kv_a_layernorm"] == StyleChoice(
        StyleKind.REPLICATE)
    assert styles[f"{attention}.q_b_proj"].kind is StyleKind.COLWISE


def test_a_linear_left_whole_beside_split_heads_is_refused_naming_it():
    """A k_proj left whole beside split q/v projections reads every head's input and feeds every
    head: not a known latent, so refused at plan time rather than trained with one rank's heads."""
    model = tiny_hf_causal_lm("llama")
    plan = TPPlanConfig(colwise_parallel=["*.q_proj", "*.v_proj"], rowwise_parallel=["*.o_proj"])
    with pytest.raises(ConfigError, match=r"tp_plan.colwise_parallel='model.layers.0.self_attn'.*"
                                          r"model.layers.0.self_attn.k_proj is a Linear.*Fix: leave"):
        resolve_tp_plan(model, plan, 2, resolve_model_facts(model))
