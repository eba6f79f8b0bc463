"""Context parallel on linear-attention models: Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE)
under Ulysses against one process, float32, 4 AdamW steps (loss rtol 1e-5, first-step
gradients rtol 1e-4); ring and hybrid refused when planning.

Packed documents: transformers' Gated DeltaNet ignores ``position_ids`` (its convolution and
delta rule run across documents), so the packed reference is one process running each
document in a forward of its own, which is what CP computes.
"""

import pytest
import torch
from cp_linear_jobs import cp_cases, reference_run
from distributed_jobs import BATCHES
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.families.qwen3_5 import Qwen35GatedDeltaNetForm
from fsdp_turbo.core.families.qwen3_next import Qwen3NextGatedDeltaNetForm
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.distributed.context_parallel.linear_attention import (
    causal_conv,
    document_bounds,
    key_heads_after_split,
)
from fsdp_turbo.distributed.context_parallel.transform import plan_context_parallel
from fsdp_turbo.fsdp_turbo_config import CPPlanConfig

pytest.importorskip("transformers")

TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}


def _plan(kind, cp, tp=1, **plan):
    model = tiny_hf_causal_lm(kind)
    return plan_context_parallel(model, CPPlanConfig(**plan), cp, resolve_model_facts(model), tp=tp)


@pytest.mark.multirank
def test_gated_deltanet_ulysses_matches_one_process():
    fsdp2 = {"context_parallel_size": 2, "fully_shard_parallel_size": 2}
    cases = [("next_cp2xfsdp2", "qwen3_next", fsdp2, "plain"),
             ("next_cp4", "qwen3_next", {"context_parallel_size": 4}, "plain"),  # 2 key heads repeated to 4
             ("next_packed_cp2xfsdp2", "qwen3_next", fsdp2, "packed"),
             ("next_packed_cp4", "qwen3_next", {"context_parallel_size": 4}, "packed"),
             ("qwen3_5_moe_cp2xfsdp2", "qwen3_5_moe", fsdp2, "plain"),
             ("qwen3_5_moe_packed_cp4", "qwen3_5_moe", {"context_parallel_size": 4}, "packed")]  # Qwen3.5's form
    expected = {(kind, loss): run_reference(reference_run, kind, BATCHES, "alone" if loss == "packed" else loss)
                for _, kind, _, loss in cases}
    for results in run_distributed(cp_cases, 4, cases, BATCHES, timeout=600):
        for name, kind, _, loss in cases:
            record, wrapped = results[name]
            assert wrapped == 1, name  # the tiny models' one linear-attention layer runs CP's forward
            assert_parity(expected[kind, loss], record, **TOL)


@pytest.mark.parametrize("mode", ["ring", "hybrid"])
def test_ring_and_hybrid_are_refused_when_planning(mode):
    plan = {"mode": mode, **({"ulysses_size": 2} if mode == "hybrid" else {})}
    with pytest.raises(ConfigError, match="mode: ulysses") as error:
        _plan("qwen3_next", 4, **plan)
    assert error.value.field == "cp_plan.mode" and "carries a state along the sequence" in str(error.value)


def test_plan_names_the_linear_layers_and_counts_only_softmax_attention():
    for kind, form in (("qwen3_next", Qwen3NextGatedDeltaNetForm), ("qwen3_5", Qwen35GatedDeltaNetForm),
                       ("qwen3_5_moe", Qwen35GatedDeltaNetForm)):
        plan = _plan(kind, 2)
        assert [(layer.name, layer.form) for layer in plan.linear_layers] == [("model.layers.0.linear_attn", form)]
        assert plan.attention_layers == 1  # layer 1's softmax attention; layer 0's is linear
        assert any(row.label == "cp_plan (linear attention)" for row in plan.describe())


def test_heads_that_do_not_split_are_refused():
    # 4 value heads: CP=4 splits them (the 2 key heads repeated to 4), CP=8 cannot.
    assert key_heads_after_split(2, 4, 2) == 2 and key_heads_after_split(2, 4, 4) == 4
    assert _plan("qwen3_next", 4).linear_layers
    with pytest.raises(ConfigError, match="divides the 4 linear-attention value heads") as error:
        _plan("qwen3_next", 8)
    assert error.value.field == "context_parallel_size"
    with pytest.raises(ConfigError) as error:
        _plan("qwen3_next", 2, tp=2)
    assert error.value.field == "tensor_parallel_size"


def test_an_unknown_recurrent_mixer_is_refused():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.A_log = nn.Parameter(torch.zeros(4))

    model = tiny_hf_causal_lm("llama")
    model.model.layers[0].mixer = Mixer()
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mixer is a recurrent token mixer"):
        plan_context_parallel(model, None, 2, resolve_model_facts(model))


def test_convolution_restarts_at_each_document():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 9, 3), torch.randn(3, 4)
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]])
    packed = causal_conv(x, weight, None, documents)
    for row in range(2):
        for doc in documents[row].unique():
            alone = causal_conv(x[row:row + 1, documents[row] == doc], weight, None, None)
            torch.testing.assert_close(packed[row:row + 1, documents[row] == doc], alone)
    assert document_bounds(documents).tolist() == [0, 4, 9, 11, 16, 18]
