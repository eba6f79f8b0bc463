"""The family files: each newest family's tiny model resolves to the facts its file states (layer
kinds with their windows, chunks and head dims; per-head parameters; latents; q/k norms over
every head; routers, indexers, compressors; sizes), and a registered family reaches a model the
library has never seen."""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.families import (
    AttentionKind,
    Family,
    HeadParameter,
    LayerKind,
    families,
    family_for,
    register_family,
    unregister_family,
)
from fsdp_turbo.core.model_facts import plain_api_facts, resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

pytest.importorskip("transformers")

# kind: (family, each layer's (kind, window, chunk), head parameters, latents, q/k norms, routers,
#        indexers, compressors, (heads, kv_heads, head_dim, v_head_dim))
EXPECTED = {
    "glm4_moe": ("glm-4-moe", [("softmax", None, None)] * 2, 0, 0, 0, 1, 0, 0, (4, 2, 16, 16)),
    "minimax_m2": ("minimax-m2", [("softmax", None, None)] * 2, 0, 0, 4, 2, 0, 0, (4, 2, 16, 16)),
    "gemma4": ("gemma-4", [("sliding", 4, None), ("softmax", None, None)] * 2, 0, 0, 0, 4, 0, 0, (4, 2, 16, 16)),
    "llama4": ("llama-4", [("chunked", None, 6)] * 3 + [("softmax", None, None)], 0, 0, 0, 2, 0, 0, (4, 2, 16, 16)),
    "kimi_linear": ("kimi-linear", [("linear", None, None), ("softmax", None, None)], 0, 2, 0, 1, 0, 0,
                    (4, 4, 24, 16)),
    "deepseek_v32": ("deepseek-v3.2", [("sparse", None, None)] * 2, 0, 8, 0, 1, 2, 0, (4, 4, 16, 12)),
    "glm_moe_dsa": ("glm-moe-dsa", [("sparse", None, None)] * 2, 0, 8, 0, 1, 1, 0, (4, 4, 16, 12)),
    "deepseek_v4": ("deepseek-v4", [("sliding", 8, None)] + [("compressed", 8, None)] * 2, 3, 0, 0, 3, 1, 2,
                    (4, 1, 32, 32)),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_family_states_its_model(kind):
    family, layers, head_params, latents, norms, routers, indexers, compressors, sizes = EXPECTED[kind]
    facts = plain_api_facts(tiny_hf_causal_lm(kind))
    assert facts.family == family
    assert [(layer.kind, layer.window, layer.chunk) for layer in facts.attention_layers] == layers
    counts = tuple(len(x) for x in (facts.head_parameters, facts.latent_modules, facts.heads_norms, facts.routers,
                                    facts.indexers, facts.compressors))
    assert counts == (head_params, latents, norms, routers, indexers, compressors)
    s = facts.sizes
    assert (s.heads, s.kv_heads, s.head_dim, s.v_head_dim) == sizes
    assert (s.experts, s.top_k) == (4 if kind == "gemma4" else 8, 2)


def test_gemma4_layers_carry_their_own_head_dim_and_the_v4_hash_router_its_token_ids():
    gemma = plain_api_facts(tiny_hf_causal_lm("gemma4"))
    assert [layer.head_dim for layer in gemma.attention_layers] == [16, 32, 16, 32]  # global layers' own head dim
    assert gemma.block_token_inputs == ("per_layer_input",)
    v4 = plain_api_facts(tiny_hf_causal_lm("deepseek_v4"))
    assert v4.block_token_inputs == ("input_ids",) and v4.after_blocks == ("model.hc_head",)
    assert {p.parameter for p in v4.head_parameters} == {"sinks"}
    llama4 = plain_api_facts(tiny_hf_causal_lm("llama4"))
    assert [layer.query_scale is not None for layer in llama4.attention_layers] == [False] * 3 + [True]


def test_a_registered_family_reaches_a_model_the_library_never_saw():
    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(8, 8)
            self.offsets = nn.Parameter(torch.zeros(4))  # one per head

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"attn": Attention()}) for _ in range(2)])

    model = Model()
    assert resolve_model_facts(model).head_parameters == ()
    family = register_family(Family(name="never-seen", head_parameters=(HeadParameter("Attention", "offsets"),)))
    try:
        assert family in families()
        facts = resolve_model_facts(model)
        assert [(p.module, p.parameter, p.dim) for p in facts.head_parameters] == [
            ("layers.0.attn", "offsets", 0), ("layers.1.attn", "offsets", 0)]
    finally:
        unregister_family("never-seen")
    assert resolve_model_facts(model).head_parameters == ()
    with pytest.raises(TypeError, match="register a Family"):
        register_family(Family(name=""))


def test_layer_kinds_come_from_the_model_type_only():
    class Config:
        model_type = "never-seen-hybrid"

    assert family_for(Config()) is None
    register_family(Family(name="hybrid", model_types=("never-seen-hybrid",),
                           layer_kinds=lambda config, layers: (LayerKind(AttentionKind.SLIDING, window=3),) * layers))
    try:
        assert family_for(Config()).name == "hybrid"
    finally:
        unregister_family("hybrid")
    assert family_for(Config()) is None
