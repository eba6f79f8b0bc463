"""Ulysses context parallel against the non-CP single-process reference, float32.

Each step's loss rtol 1e-5 for 4 AdamW steps, and the first step's full gradients rtol
1e-4 / atol 1e-6. The training loop passes full-length inputs, exactly as without CP.
"""

import pytest
from cp_jobs import (
    ODD_BATCHES,
    count_collectives_run,
    cp_run,
    reference_run,
    tiny_lm_cp_run,
    tiny_lm_reference,
)
from distributed_jobs import BATCHES

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}
_cache = {}
TP_PLAN = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
           "rowwise_parallel": ["*.o_proj", "*.down_proj"]}


def reference(kind, batches=BATCHES, model_kwargs=None, loss=None):
    key = (kind, id(batches), repr(model_kwargs), loss)
    if key not in _cache:
        _cache[key] = run_reference(reference_run, kind, batches, model_kwargs, loss, timeout=300)
    return _cache[key]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("layout", ["cp2xfsdp2", "cp4"])
def test_cp_parity(kind, layout):
    """Llama and Qwen3 have 4 heads and 2 K/V heads: at CP=4 each K/V head is replicated."""
    config = {"context_parallel_size": 2 if layout == "cp2xfsdp2" else 4}
    for record, implementation in run_distributed(cp_run, 4, kind, BATCHES, config, timeout=300):
        assert_parity(reference(kind), record, **TOL)
        assert implementation.startswith("fsdp_turbo_ulysses") and implementation.endswith("sdpa")


def test_odd_length_and_ignored_labels_eager_attention():
    """Sequence 15 over CP=4 (padded to 16), a quarter of the labels -100 and the last CP
    chunk entirely ignored (no NaN); the model's eager attention is the one wrapped."""
    kwargs = {"attn_implementation": "eager"}
    for record, implementation in run_distributed(cp_run, 4, "llama", ODD_BATCHES, {"context_parallel_size": 4},
                                                  kwargs, "masked", timeout=300):
        assert_parity(reference("llama", ODD_BATCHES, kwargs, "masked"), record, **TOL)
        assert implementation.endswith("eager")


def test_padding_attention_mask():
    config = {"context_parallel_size": 2, "fully_shard_parallel_size": 2}
    for record, _ in run_distributed(cp_run, 4, "qwen3", ODD_BATCHES, config, None, "padded", timeout=300):
        assert_parity(reference("qwen3", ODD_BATCHES, None, "padded"), record, **TOL)


def test_cp2_x_tp2():
    """4 heads over TP=2 x CP=2; one K/V head per TP rank, replicated for CP."""
    config = {"context_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": TP_PLAN}
    for record, _ in run_distributed(cp_run, 4, "llama", BATCHES, config, timeout=300):
        assert_parity(reference("llama"), record, **TOL)


def test_attention_all_to_all_is_the_only_cp_communication():
    """One step at CP=4 (FSDP over the 4 ranks too): per decoder layer one all-to-all for
    Q/K/V and one for the output, each way, plus one scalar all-reduce for the loss; every
    other collective is FSDP's all-gather / reduce-scatter."""
    counts = run_distributed(count_collectives_run, 4, "llama", BATCHES, {"context_parallel_size": 4},
                             timeout=300)[0]
    layers = 2
    assert counts.pop("_c10d_functional::all_to_all_single") == 4 * layers
    assert counts.pop("c10d::allreduce_") == 1
    assert set(counts) <= {"c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced",
                           "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced"}, counts


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_non_hf_model_by_attention_function_path(mode):
    """Ulysses runs the named function on head shards; the ring stands in for it (causal SDPA)."""
    expected = run_reference(tiny_lm_reference, BATCHES, timeout=300)
    config = {"context_parallel_size": 2, "model_facts": {"attention_function": "cp_jobs.core_attention"},
              "cp_plan": {"mode": mode}}
    for record in run_distributed(tiny_lm_cp_run, 2, BATCHES, config, timeout=300):
        assert_parity(expected, record, **TOL)


def test_cp2_x_ep2_moe_sees_local_tokens():
    """Qwen3-MoE at CP=2 x EP=2: the MoE layers route only their rank's sequence chunk."""
    from ep_jobs import ep_run
    from ep_jobs import reference_run as moe_reference_run

    expected = run_reference(moe_reference_run, "qwen3_moe", BATCHES, timeout=300)
    config = {"context_parallel_size": 2, "expert_parallel_size": 2, "ep_plan": {"dispatcher": "mc2"}}
    for record, _, _ in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, config, timeout=300):
        assert_parity(expected, record, **TOL)


def test_a_model_that_bound_its_attention_early_is_refused_on_every_rank():
    from cp_jobs import cp_with_attention_bound_early

    config = {"context_parallel_size": 2, "model_facts": {"attention_function": "cp_jobs.core_attention"}}
    errors = run_distributed(cp_with_attention_bound_early, 2, config, timeout=120, return_exceptions=True)
    assert all(isinstance(e, ConfigError) and "ran in 0 of 1 attention layers" in str(e) for e in errors), errors


def test_heads_ulysses_cannot_split_are_refused_on_every_rank_before_the_all_to_all():
    from cp_jobs import cp_with_indivisible_heads

    config = {"context_parallel_size": 2, "model_facts": {"attention_function": "cp_jobs.core_attention"}}
    errors = run_distributed(cp_with_indivisible_heads, 2, config, timeout=120, return_exceptions=True)
    assert all(isinstance(e, ConfigError) and e.field == "context_parallel_size" and "3 query heads" in str(e)
               for e in errors), errors


def test_output_attentions_under_cp_is_refused_on_every_rank():
    from cp_jobs import cp_with_output_attentions

    errors = run_distributed(cp_with_output_attentions, 2, timeout=120, return_exceptions=True)
    assert all(isinstance(e, ConfigError) and e.field == "output_attentions" for e in errors), errors


@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_cp4_on_two_kv_heads(load_balance):
    """CP=4 ring on a model with 2 K/V heads: past what Ulysses can do without replication."""
    config = {"context_parallel_size": 4, "cp_plan": {"mode": "ring", "load_balance": load_balance}}
    for record, implementation in run_distributed(cp_run, 4, "llama", BATCHES, config, timeout=300):
        assert_parity(reference("llama"), record, **TOL)
        assert implementation.startswith("fsdp_turbo_ring")


def test_ring_odd_length_ignored_labels_and_padding():
    ring = {"mode": "ring"}
    for record, _ in run_distributed(cp_run, 4, "llama", ODD_BATCHES, {"context_parallel_size": 4, "cp_plan": ring},
                                     None, "masked", timeout=300):
        assert_parity(reference("llama", ODD_BATCHES, None, "masked"), record, **TOL)
    config = {"context_parallel_size": 2, "fully_shard_parallel_size": 2, "cp_plan": ring}
    for record, _ in run_distributed(cp_run, 4, "qwen3", ODD_BATCHES, config, None, "padded", timeout=300):
        assert_parity(reference("qwen3", ODD_BATCHES, None, "padded"), record, **TOL)


def test_ring_cp2_x_tp2():
    config = {"context_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": TP_PLAN, "cp_plan": {"mode": "ring"}}
    for record, _ in run_distributed(cp_run, 4, "llama", BATCHES, config, timeout=300):
        assert_parity(reference("llama"), record, **TOL)


def test_ring_cp2_x_ep2_moe():
    from ep_jobs import ep_run
    from ep_jobs import reference_run as moe_reference_run

    expected = run_reference(moe_reference_run, "qwen3_moe", BATCHES, timeout=300)
    config = {"context_parallel_size": 2, "expert_parallel_size": 2, "ep_plan": {"dispatcher": "fused"},
              "cp_plan": {"mode": "ring"}}
    for record, _, _ in run_distributed(ep_run, 4, "qwen3_moe", BATCHES, config, timeout=300):
        assert_parity(expected, record, **TOL)


def test_ring_sends_only_key_value_chunks_around_the_ring():
    """One step at CP=4 ring: per layer, the forward passes K and V on 3 times and the
    backward K, V, dK, dV 3 times and dK, dV once more (home): 2*3 + 4*3 + 2 sends."""
    counts = run_distributed(count_collectives_run, 4, "llama", BATCHES,
                             {"context_parallel_size": 4, "cp_plan": {"mode": "ring"}}, timeout=300)[0]
    layers = 2
    assert counts.pop("c10d::send") == (2 * 3 + 4 * 3 + 2) * layers, counts
    assert counts.pop("c10d::recv_") == (2 * 3 + 4 * 3 + 2) * layers, counts
    assert "_c10d_functional::all_to_all_single" not in counts
    assert counts.pop("c10d::allreduce_") == 1
    assert set(counts) <= {"c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced",
                           "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced"}, counts


@pytest.mark.parametrize("load_balance", [True, False])
def test_hybrid_ulysses2_x_ring2(load_balance):
    config = {"context_parallel_size": 4,
              "cp_plan": {"mode": "hybrid", "ulysses_size": 2, "load_balance": load_balance}}
    for record, implementation in run_distributed(cp_run, 4, "llama", BATCHES, config, timeout=300):
        assert_parity(reference("llama"), record, **TOL)
        assert implementation.startswith("fsdp_turbo_hybrid")


KV_LAYOUTS = {
    "cp2 x fsdp2": {"context_parallel_size": 2, "fully_shard_parallel_size": 2, "cp_plan": {"mode": "kv_allgather"}},
    "cp2 x tp2": {"context_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": TP_PLAN,
                  "cp_plan": {"mode": "kv_allgather"}},
    "ulysses2 x kv_allgather2": {"context_parallel_size": 4, "cp_plan": {"mode": "kv_allgather", "ulysses_size": 2}},
}


@pytest.mark.parametrize("layout", sorted(KV_LAYOUTS))
def test_kv_allgather(layout):
    """Each rank keeps its queries and all-gathers K and V (zig-zag chunks): beside FSDP, beside
    TP (each rank's heads), and inside Ulysses (the upstream's kv_allgather_parallel_size x
    ulysses)."""
    config = KV_LAYOUTS[layout]
    for record, implementation in run_distributed(cp_run, 4, "llama", BATCHES, config, timeout=300):
        assert_parity(reference("llama"), record, **TOL)
        assert implementation.startswith("fsdp_turbo_kv_allgather")


def test_kv_allgather_gathers_keys_and_values_once_each_way():
    """One step at CP=4 KV all-gather: per layer, the forward all-gathers K and V; the backward
    gathers them again and reduce-scatters dK and dV to their owners. Nothing else for CP."""
    counts = run_distributed(count_collectives_run, 4, "llama", BATCHES,
                             {"context_parallel_size": 4, "cp_plan": {"mode": "kv_allgather"}}, timeout=300)[0]
    layers = 2
    assert counts.pop("c10d::allgather_") == 4 * layers, counts
    assert counts.pop("c10d::reduce_scatter_") == 2 * layers, counts
    assert "c10d::send" not in counts and "_c10d_functional::all_to_all_single" not in counts
    assert counts.pop("c10d::allreduce_") == 1
    assert set(counts) <= {"c10d::_allgather_base_", "c10d::allgather_into_tensor_coalesced",
                           "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_tensor_coalesced"}, counts
