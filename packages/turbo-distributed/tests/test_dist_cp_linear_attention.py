"""Context parallel on linear-attention models: Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE)
under Ulysses against one process, float32, 4 AdamW steps (loss rtol 1e-5, first-step
gradients rtol 1e-4); ring and hybrid refused when planning.

Packed documents: transformers' Gated DeltaNet ignores ``position_ids`` (its convolution and
delta rule run across documents), so the packed reference is one process running each
document in a forward of its own, which is what CP computes.
"""

import pytest
import torch
from cp_linear_jobs import cp_cases, replay_cases
from distributed_jobs import BATCHES
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.families.qwen3_5 import Qwen35GatedDeltaNetForm
from fsdp_turbo.core.families.qwen3_next import Qwen3NextGatedDeltaNetForm
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing import run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import assert_stepwise_parity
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


# Each step's update per tensor, relative L2 (a check the whole-trajectory comparison did not
# make). AdamW's update lr * m / (sqrt(v) + eps) has slope up to lr / eps where a gradient is near
# zero: the embedding rows of tokens seen once in a batch hold such gradients, and Qwen3.5-MoE's
# embedding update at CP=2 x FSDP=2 came out 1.2e-4 from the replay's (gradients within 1e-4 /
# 1e-6), so 5e-4; a wrong update is off by order one.
UPDATE_RTOL = 5e-4


@pytest.mark.multirank
def test_gated_deltanet_ulysses_matches_one_process(tmp_path):
    """Every step against the one-process model replayed from the case's own weights before it
    (``replay_steps``): each step's loss and gradients at the float32 tolerances, and its update. The
    first step starts from the reference model's own weights (the replay checks them), so it is
    the plain comparison. Whole trajectories are machine-dependent for these models: on an Intel
    Xeon, CP=4's step 3 was off by 1.1e-5 where an AMD EPYC passed, and the one-process run
    itself moves by 1.2e-5 at step 3 when its weights are nudged by 3e-6 (relative, random): a
    discrete switch within rounding of a whole-trajectory comparison, not an error of the layout."""
    fsdp2 = {"context_parallel_size": 2, "fully_shard_parallel_size": 2}
    cases = [("next_cp2xfsdp2", "qwen3_next", fsdp2, "plain"),
             ("next_cp4", "qwen3_next", {"context_parallel_size": 4}, "plain"),  # 2 key heads repeated to 4
             ("next_packed_cp2xfsdp2", "qwen3_next", fsdp2, "packed"),
             ("next_packed_cp4", "qwen3_next", {"context_parallel_size": 4}, "packed"),
             ("qwen3_5_moe_cp2xfsdp2", "qwen3_5_moe", fsdp2, "plain"),
             ("qwen3_5_moe_packed_cp4", "qwen3_5_moe", {"context_parallel_size": 4}, "packed")]  # Qwen3.5's form
    ranks = run_distributed(cp_cases, 4, cases, BATCHES, True, timeout=600)
    torch.save({name: record.params for name, (record, _) in ranks[0].items()}, tmp_path / "params.pt")
    replayed = run_reference(replay_cases, cases, BATCHES, str(tmp_path / "params.pt"), timeout=600)
    for results in ranks:
        for name, *_ in cases:
            record, wrapped = results[name]
            assert wrapped == 1, name  # the tiny models' one linear-attention layer runs CP's forward
            assert_stepwise_parity(replayed[name], record, loss_rtol=TOL["loss_rtol"], grad_rtol=TOL["grad_rtol"],
                                   grad_atol=TOL["grad_atol"], update_rtol=UPDATE_RTOL)


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
