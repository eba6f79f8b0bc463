"""Recompute: bitwise parity with the plain model, and what a checkpointed layer keeps."""

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import make_token_batches, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.recompute import apply_recompute, is_recomputed, resolve_save_ops

BATCHES = make_token_batches(vocab_size=256, global_batch=2, seq_len=16, steps=3)
POLICIES = ["full", "selective", ("aten.mm", "aten::addmm")]


def _assert_bitwise(reference, candidate):
    assert reference.losses == candidate.losses
    for name, grad in reference.grads.items():
        assert torch.equal(grad, candidate.grads[name]), name


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("policy", POLICIES, ids=["full", "selective", "ops"])
def test_plain_api_is_bitwise(kind, policy):
    reference = tiny_hf_causal_lm(kind, seed=0)
    model = tiny_hf_causal_lm(kind, seed=0)
    apply_recompute(model.model.layers, policy)
    expected, got = train_steps(reference, BATCHES), train_steps(model, BATCHES)
    _assert_bitwise(expected, got)
    after = _params(model)
    for name, value in _params(reference).items():
        assert torch.equal(value, after[name]), name


@pytest.mark.parametrize("policy", POLICIES, ids=["full", "selective", "ops"])
def test_facade_is_bitwise_and_keeps_names(policy):
    reference = tiny_hf_causal_lm("llama", seed=0)
    names = [n for n, _ in reference.named_parameters()]
    config = FSDPTurboConfig(recompute=True, recompute_plan=["model.layers.*"], recompute_policy=policy)
    model = FSDPTurbo(config, tiny_hf_causal_lm("llama", seed=0))
    assert all(is_recomputed(layer) for layer in model.model.layers)
    assert not is_recomputed(model.model.layers[0].mlp)  # outermost matches only
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == list(reference.state_dict())
    _assert_bitwise(train_steps(reference, BATCHES), train_steps(model, BATCHES))


def test_default_plan_is_the_repeated_blocks():
    model = FSDPTurbo(FSDPTurboConfig(recompute=True), tiny_hf_causal_lm("qwen3"))
    assert [is_recomputed(m) for m in model.model.layers] == [True, True]


def _activation_bytes_after_forward(layers: int, policy: str | None, batch=2, seq=128) -> int:
    model = tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=layers)
    if policy:
        apply_recompute(model.model.layers, policy)
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state
        acts = {str(k): v for per_device in tracker.get_tracker_snapshot("current").values()
                for k, v in per_device.items()}["_MemRefType.ACT"]
        out.sum().backward()
    return acts


def test_full_recompute_keeps_only_the_layer_inputs():
    # Adding two checkpointed layers adds exactly two [batch, seq, hidden] fp32 tensors:
    # their inputs. Without recompute each layer keeps far more.
    def added(policy):
        return _activation_bytes_after_forward(4, policy) - _activation_bytes_after_forward(2, policy)

    layer_input = 2 * 128 * 64 * 4
    assert added("full") == 2 * layer_input
    plain = added(None)
    selective = added("selective")
    assert plain > 10 * layer_input
    # Selective keeps the matmul and attention outputs: between the two.
    assert 2 * layer_input < selective < plain


def test_bad_inputs_raise_config_errors():
    with pytest.raises(ConfigError, match="no such operator"):
        resolve_save_ops(["aten.not_an_op"])
    with pytest.raises(ConfigError, match="recompute_plan"):
        FSDPTurbo(FSDPTurboConfig(recompute=True, recompute_plan=["model.blocks.*"]), tiny_hf_causal_lm())
    with pytest.raises(ConfigError, match="no such operator"):
        FSDPTurbo(FSDPTurboConfig(recompute=True, recompute_policy=["aten.nope"]), tiny_hf_causal_lm())
    model = tiny_hf_causal_lm()
    apply_recompute([model.model.layers[0]])
    with pytest.raises(ConfigError, match="already checkpointed"):
        apply_recompute([model.model.layers[0]])
