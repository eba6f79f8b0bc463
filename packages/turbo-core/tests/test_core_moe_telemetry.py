"""MoE telemetry in one process: what it reports against a hand count of the same routing."""

import math

import pytest
import torch

from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.moe_telemetry import MoETelemetry
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

pytest.importorskip("transformers")


def test_load_imbalance_entropy_and_drops_match_a_hand_count():
    model = tiny_hf_causal_lm("qwen3_moe")
    facts = resolve_model_facts(model)  # its routers (expert containers are found by the forms EP registers)
    experts = tuple(name for name, _ in model.named_modules() if name.endswith("mlp.experts"))
    seen, logits = {}, {}

    def keep(into, name, value) -> None:  # hooks that return None change nothing
        into[name] = value

    for name in experts:  # the routing, captured beside the telemetry
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, n=name: keep(seen, n, a[1]))
    for name in facts.routers:
        model.get_submodule(name).register_forward_hook(lambda m, a, out, n=name: keep(logits, n, out[0]))
    telemetry = MoETelemetry(model, experts, facts.routers, ep=2)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    row = telemetry.read()
    for name in experts:
        layer = name.rpartition(".")[0]
        counts = torch.bincount(seen[name].reshape(-1), minlength=8).double()
        share = counts / counts.sum()
        assert row[f"moe/{layer}/load"] == [round(float(s), 6) for s in share]
        assert row[f"moe/{layer}/imbalance"] == pytest.approx(float(share.max() * 8))
        assert row[f"moe/{layer}/ep_rank_share"] == [round(float(s), 6) for s in share.view(2, 4).sum(1)]
        assert row[f"moe/{layer}/dropped"] == 0.0
        router = next(r for r in facts.routers if r.startswith(layer + "."))
        probs = logits[router].float().softmax(-1)
        entropy = float(-(probs * probs.log()).sum(-1).mean()) / math.log(8)
        assert row[f"moe/{layer}/router_entropy"] == pytest.approx(entropy, rel=1e-5)
    assert row["moe/imbalance_max"] == max(v for k, v in row.items() if k.endswith("/imbalance"))
    # counts reset after each read; slots routed past the last expert count as dropped
    name = experts[0]
    model.get_submodule(name)(torch.zeros(3, 64), torch.tensor([[0, 8], [8, 8], [1, 2]]), torch.ones(3, 2))
    again = telemetry.read()
    assert again[f"moe/{name.rpartition('.')[0]}/dropped"] == pytest.approx(3 / 6)
    assert f"moe/{experts[1].rpartition('.')[0]}/load" not in again


def test_a_container_that_balances_its_rows_reports_what_each_rank_computed():
    """A container with ``moe_rank_rows()`` (redundant experts) adds the rows each EP rank really
    computed, beside the share its experts were routed."""
    from torch import nn

    from fsdp_turbo.core.moe_telemetry import MoETelemetry

    class Balanced(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 2, 2))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

        def moe_rank_rows(self):
            return [3, 1]

    holder = nn.Module()
    holder.mlp = nn.Module()
    holder.mlp.experts = Balanced()
    telemetry = MoETelemetry(holder, ("mlp.experts",), ep=2)
    holder.mlp.experts(torch.zeros(2, 2), torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2))
    row = telemetry.read()
    assert row["moe/mlp/ep_rank_share"] == [1.0, 0.0] and row["moe/mlp/ep_imbalance"] == 2.0
    assert row["moe/mlp/ep_rank_share_balanced"] == [0.75, 0.25] and row["moe/mlp/ep_imbalance_balanced"] == 1.5
    assert "moe/mlp/ep_rank_share_balanced" not in telemetry.read()  # reset by the read
