"""``router_bias_update_rate`` in one process: the rule, the routers it finds, what it refuses."""

import pytest
import torch

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.router_bias import RouterBiasBalancer, biased_routers, check_biased_routers
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

pytest.importorskip("transformers")


def _experts(model):
    return tuple(n for n, _ in model.named_modules() if n.endswith("mlp.experts"))


def test_each_bias_moves_by_the_rate_towards_the_mean_load():
    bias = torch.zeros(4)
    # loads 3, 1, 2, 0 (one dropped slot, id 4): mean 1.5
    RouterBiasBalancer([], rate=0.25).update(bias, torch.tensor([[0, 1], [0, 2], [0, 2], [4, 4]]))
    assert bias.tolist() == [-0.25, 0.25, -0.25, 0.25]
    RouterBiasBalancer([], rate=0.25).update(bias, torch.tensor([[0, 1], [2, 3]]))  # even: no move
    assert bias.tolist() == [-0.25, 0.25, -0.25, 0.25]


def test_deepseek_routers_are_paired_with_their_experts():
    model = tiny_hf_causal_lm("deepseek_v3")
    pairs = biased_routers(model, _experts(model))
    assert pairs and all(router is container_block.gate for (_, router), container_block in
                         zip(pairs, [model.get_submodule(n.rsplit(".", 1)[0]) for n in _experts(model)], strict=True))


def test_training_forwards_move_the_bias_and_evaluation_does_not():
    model = tiny_hf_causal_lm("deepseek_v3")
    balancer = RouterBiasBalancer(biased_routers(model, _experts(model)), rate=0.1)
    tokens = torch.randint(0, 100, (2, 16))
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    with torch.no_grad():
        model.eval()
        model(input_ids=tokens)
    assert all(not b.any() for b in biases)
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert all(b.abs().max() == pytest.approx(0.1) for b in biases)
    balancer.remove()
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert all(b.abs().max() == pytest.approx(0.1) for b in biases)


def test_a_model_without_biased_routers_is_refused():
    model = tiny_hf_causal_lm("qwen3_moe")
    with pytest.raises(ConfigError) as raised:
        check_biased_routers(model, _experts(model), 0.001)
    assert raised.value.field == "router_bias_update_rate" and "e_score_correction_bias" in str(raised.value)
    check_biased_routers(model, _experts(model), 0.0)  # off: nothing to check
