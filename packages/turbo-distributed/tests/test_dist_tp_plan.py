"""TP plan resolution in one process: which style each module gets, and why."""

import pytest

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.tensor_parallel import resolve_tp_plan
from fsdp_turbo.fsdp_turbo_config import TPPlanConfig

pytest.importorskip("transformers")


def _resolve(model, plan, tp=2):
    return resolve_tp_plan(model, plan, tp, resolve_model_facts(model))

FULL = TPPlanConfig(colwise_parallel=["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
                    rowwise_parallel=["*.o_proj", "*.down_proj", "model.embed_tokens"],
                    sequence_parallel=["*layernorm", "model.norm"], loss_parallel=True)


def test_qwen3_full_plan_kinds():
    kinds = _resolve(tiny_hf_causal_lm("qwen3"), FULL).kinds
    assert kinds["model.layers.0.self_attn"] == "prepare_input"
    assert kinds["model.layers.0.mlp"] == "prepare_input"
    assert kinds["model.layers.0.self_attn.q_norm"] == "head_local"
    assert kinds["model.layers.1.input_layernorm"] == "sequence_parallel"
    assert kinds["model.layers.0"] == "scatter_sequence"
    assert kinds["lm_head"] == "colwise" and kinds["model.embed_tokens"] == "rowwise"
    assert "replicate" not in kinds.values()


def test_llama_without_sp_replicates_the_norms():
    plan = TPPlanConfig(colwise_parallel=["*.q_proj", "*.k_proj", "*.v_proj"], rowwise_parallel=["*.o_proj"])
    resolved = _resolve(tiny_hf_causal_lm("llama"), plan)
    assert resolved.kinds["model.norm"] == "replicate"
    assert resolved.kinds["model.layers.0.mlp.gate_proj"] == "replicate"
    assert resolved.kinds["lm_head"] == "replicate"
    assert resolved.loss_head is None and resolved.tied == ()


def test_sp_without_a_sharded_head_gathers_before_it():
    plan = TPPlanConfig(colwise_parallel=["*.q_proj", "*.k_proj", "*.v_proj"], rowwise_parallel=["*.o_proj"],
                        sequence_parallel=["*layernorm", "model.norm"])
    assert _resolve(tiny_hf_causal_lm("llama"), plan).kinds["lm_head"] == "gather_replicate"


def test_norms_in_the_blocks_left_out_of_sequence_parallel_compute_on_each_ranks_tokens():
    """Inside the blocks a norm left out of the SP plan runs on the rank's tokens with its gradient
    summed over TP (as a sequence-parallel norm does); an attention the plan leaves unsplit is kept
    whole on the gathered sequence (it must see every token)."""
    plan = TPPlanConfig(colwise_parallel=["*.gate_proj", "*.up_proj"], rowwise_parallel=["*.down_proj"],
                        sequence_parallel=["model.norm"])
    kinds = _resolve(tiny_hf_causal_lm("llama"), plan).kinds
    assert kinds["model.layers.0.input_layernorm"] == "replicate_sequence_local"
    assert kinds["model.layers.0.self_attn"] == "whole_gathered"


def test_tied_embeddings_are_recorded():
    model = tiny_hf_causal_lm("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    resolved = _resolve(model, FULL)
    assert sorted(m for m, _ in resolved.tied[0]) == ["lm_head", "model.embed_tokens"]


@pytest.mark.parametrize("plan,message", [
    (TPPlanConfig(colwise_parallel=["model.layers.*.mlp"]), "which tensor parallel cannot shard"),
    (TPPlanConfig(colwise_parallel=["*.q_proj"], loss_parallel=True), "output head"),
    # the final norm, after the blocks, left out of sequence parallel would see shards as if replicated
    (TPPlanConfig(colwise_parallel=["*.q_proj", "*.k_proj", "*.v_proj"], rowwise_parallel=["*.o_proj"],
                  sequence_parallel=["*layernorm"]), "every norm"),
    # q split by head, k and v left whole beside it: not per head, refused by name
    (TPPlanConfig(colwise_parallel=["*.q_proj"]), r"self_attn.k_proj is a Linear of LlamaAttention"),
])
def test_bad_plans(plan, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(tiny_hf_causal_lm("llama"), plan)


def _scatter_twice():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.tensor_parallel.styles import ScatterSequence

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    style = ScatterSequence()
    full = torch.arange(16.0).reshape(1, 4, 4)
    local = style._convert(full, mesh)
    # Recompute re-runs the first block with the inputs it saved: already scattered ones.
    return tuple(local.shape), style._convert(local, mesh) is local, local[0, 0, 0].item()


@pytest.mark.multirank
def test_sequence_scatter_is_idempotent_for_recompute():
    from fsdp_turbo.core.testing import run_distributed

    results = run_distributed(_scatter_twice, 2, timeout=120)
    assert [r[:2] for r in results] == [((1, 2, 4), True)] * 2
    assert [r[2] for r in results] == [0.0, 8.0]


QWEN3_NEXT_ATTENTION = dict(colwise_parallel=["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj"],
                            rowwise_parallel=["*.self_attn.o_proj"])


@pytest.mark.parametrize("sp,kind", [(False, "whole"), (True, "whole_gathered")])
def test_gated_deltanet_is_kept_whole_beside_split_attention(sp, kind):
    """Qwen3-Next: the softmax layers split by head, the Gated DeltaNet (A_log, dt_bias beside its
    projections, convolution and norm) kept whole; under sequence parallel on the gathered sequence."""
    norms = dict(sequence_parallel=["*input_layernorm", "*post_attention_layernorm", "model.norm"]) if sp else {}
    kinds = _resolve(tiny_hf_causal_lm("qwen3_next"), TPPlanConfig(**QWEN3_NEXT_ATTENTION, **norms)).kinds
    assert kinds["model.layers.0.linear_attn"] == kind
    assert not any(name.startswith("model.layers.0.linear_attn.") for name in kinds)  # its subtree is one style
    assert kinds["model.layers.1.self_attn"] == "prepare_input"


def test_a_split_inside_the_gated_deltanet_is_refused_at_plan_time():
    plan = TPPlanConfig(colwise_parallel=QWEN3_NEXT_ATTENTION["colwise_parallel"],
                        rowwise_parallel=[*QWEN3_NEXT_ATTENTION["rowwise_parallel"], "*.linear_attn.out_proj"])
    with pytest.raises(ConfigError, match=r"inside model.layers.0.linear_attn, a linear-attention layer "
                                          r"\(Gated DeltaNet \(Qwen3-Next\)\)") as caught:
        _resolve(tiny_hf_causal_lm("qwen3_next"), plan)
    assert caught.value.value == "*.linear_attn.out_proj"
    assert "TP keeps it whole" in caught.value.fix


def test_deepseek_v4s_attention_is_kept_whole_and_refused_when_split():
    """One key/value head that every query head reads, and compressed entries: V4's attention is
    kept whole on the gathered sequence (the plan splits its MLPs); splitting it is refused by name."""
    from fsdp_turbo.core.model_facts import plain_api_facts

    model = tiny_hf_causal_lm("deepseek_v4")
    mlp = TPPlanConfig(colwise_parallel=["*.shared_experts.gate_proj", "*.shared_experts.up_proj"],
                       rowwise_parallel=["*.shared_experts.down_proj"], sequence_parallel=["model.norm"])
    kinds = resolve_tp_plan(model, mlp, 2, plain_api_facts(model)).kinds
    assert {kinds[f"model.layers.{i}.self_attn"] for i in range(3)} == {"whole_gathered"}
    # after the blocks, beside the final norm: on each rank's tokens, its gradient summed over TP
    assert kinds["model.hc_head"] == "replicate_sequence_local"
    split = TPPlanConfig(colwise_parallel=["*.self_attn.q_b_proj"], rowwise_parallel=["*.self_attn.o_b_proj"])
    with pytest.raises(ConfigError, match="leave the attention out of tp_plan") as error:
        resolve_tp_plan(model, split, 2, plain_api_facts(model))
    assert error.value.field == "tensor_parallel_size" and "num_key_value_heads=1" in str(error.value)
