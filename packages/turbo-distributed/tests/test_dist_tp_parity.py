"""Tensor, sequence and loss parallel on unmodified HF models, against the
single-process reference, in float32 (same global batch and seed).

Tolerances: each step's loss rtol 1e-5 for 4 AdamW steps; the first step's full
gradients rtol 1e-4 / atol 1e-6; with clipping, each step's total gradient norm
within the same gradient tolerance.
"""

import pytest
from distributed_jobs import BATCHES, TOLERANCES, facade_run, reference_run

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

QKV = ["*.q_proj", "*.k_proj", "*.v_proj"]
MLP_COLWISE = ["*.gate_proj", "*.up_proj"]
NORMS = ["*layernorm", "model.norm"]


def tp_plan(*, sp=False, loss_parallel=False, embedding=False, head=False):
    plan = {"colwise_parallel": QKV + MLP_COLWISE, "rowwise_parallel": ["*.o_proj", "*.down_proj"]}
    if loss_parallel or head:
        # Without loss parallel a colwise head gathers whole-vocabulary logits.
        plan["colwise_parallel"] = [*plan["colwise_parallel"], "lm_head"]
    if loss_parallel:
        plan["loss_parallel"] = True
    if embedding:
        plan["rowwise_parallel"] = [*plan["rowwise_parallel"], "model.embed_tokens"]
    if sp:
        plan["sequence_parallel"] = NORMS
    return plan


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(kind, model_kwargs=None, clip=None):
        key = (kind, tuple(sorted((model_kwargs or {}).items())), clip)
        if key not in cache:
            cache[key] = run_reference(reference_run, kind, BATCHES, model_kwargs, clip, timeout=300)
        return cache[key]

    return get


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
def test_seed_quick_start_fsdp2_x_tp2(kind, reference):
    """The seed's example scaled to 4 ranks: q/k/v colwise, o_proj rowwise, FSDP over the rest.
    In Qwen3-MoE the router and the fused experts run replicated over TP."""
    config = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
              "fsdp_plan": {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1},
              "tp_plan": {"colwise_parallel": QKV, "rowwise_parallel": ["*.o_proj"]}}
    for record in run_distributed(facade_run, 4, kind, BATCHES, config, timeout=300):
        assert_parity(reference(kind), record, **TOLERANCES)


CASES = [(tp, sp, lp) for tp in (2, 4) for sp in (False, True) for lp in (False, True)]


@pytest.mark.parametrize("tp,sp,loss_parallel", CASES, ids=[f"tp{t}-sp{int(s)}-lp{int(lp)}" for t, s, lp in CASES])
def test_tp_attention_and_mlp(tp, sp, loss_parallel, reference):
    kind = "qwen3" if sp else "llama"
    model_kwargs = {"num_key_value_heads": 4} if tp == 4 else {}
    config = {"tensor_parallel_size": tp,
              "tp_plan": tp_plan(sp=sp, loss_parallel=loss_parallel, embedding=tp == 4, head=tp == 4)}
    results = run_distributed(facade_run, tp, kind, BATCHES, config, model_kwargs, inspect=True, timeout=300)
    for record, _ in results:
        assert_parity(reference(kind, model_kwargs), record, **TOLERANCES)
    facts = results[0][1]
    assert all(facts["dtensor"].values()), "every parameter lives on the TP mesh"
    q_rows = facts["local_rows"]["model.layers.0.self_attn.q_proj.weight"]
    assert q_rows == 64 // tp
    logits_type, logits_placements, logits_local_shape = facts["logits"]
    if loss_parallel:
        # The full [tokens, vocab] logits are never gathered: each rank holds vocab/tp columns.
        assert logits_type == "DTensor" and "Shard(dim=2)" in logits_placements
        assert logits_local_shape[-1] == 256 // tp
    else:
        assert logits_type == "Tensor" and logits_local_shape[-1] == 256


def test_fsdp_tp_sp_loss_parallel_with_clipping(reference):
    """clip_grad_norm_ over the mixed 2-D DTensor parameters gives the reference's norm."""
    config = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
              "tp_plan": tp_plan(sp=True, loss_parallel=True, embedding=True)}
    for record in run_distributed(facade_run, 4, "qwen3", BATCHES, config, None, 0.5, timeout=300):
        expected = reference("qwen3", None, 0.5)
        assert len(record.grad_norms) == len(BATCHES) and max(expected.grad_norms) > 0.5  # clipping is active
        assert_parity(expected, record, **TOLERANCES)


def test_hsdp_with_tp(reference):
    config = {"data_parallel_size": 2, "fully_shard_parallel_size": 1, "tensor_parallel_size": 2,
              "tp_plan": tp_plan(loss_parallel=True)}
    for record in run_distributed(facade_run, 4, "llama", BATCHES, config, timeout=300):
        assert_parity(reference("llama"), record, **TOLERANCES)


def test_tied_embeddings_stay_tied(reference):
    model_kwargs = {"tie_word_embeddings": True}
    config = {"tensor_parallel_size": 2, "tp_plan": tp_plan(loss_parallel=True, embedding=True)}
    results = run_distributed(facade_run, 2, "llama", BATCHES, config, model_kwargs, inspect=True, timeout=300)
    for record, facts in results:
        assert "lm_head.weight" not in facts["dtensor"]  # still one parameter, listed once
        assert_parity(reference("llama", model_kwargs), record, **TOLERANCES)


def test_moe_router_and_experts_inside_the_sequence_region(reference):
    """Sequence parallel with Qwen3-MoE: the replicated router and experts see each rank's
    tokens only, so their gradients are summed over TP (they were not: a 50% error)."""
    config = {"tensor_parallel_size": 2,
              "tp_plan": {"colwise_parallel": [*QKV, "lm_head"], "rowwise_parallel": ["*.o_proj"],
                          "sequence_parallel": NORMS, "loss_parallel": True}}
    for record in run_distributed(facade_run, 2, "qwen3_moe", BATCHES, config, timeout=300):
        assert_parity(reference("qwen3_moe"), record, **TOLERANCES)
