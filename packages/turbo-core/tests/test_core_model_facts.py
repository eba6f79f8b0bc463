"""ModelFacts: what the model is, resolved once; configured facts win over detection; the
fields that moved into ``model_facts`` name their new place."""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.expert_forms import add_expert_form, remove_expert_form
from fsdp_turbo.core.lm_loss import lm_loss
from fsdp_turbo.core.model_facts import IGNORE_INDEX, ModelFactsConfig, resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import (
    ChunkLossPlanConfig,
    CPPlanConfig,
    FSDPTurboConfig,
    QuantizeConfig,
    TPPlanConfig,
)


def test_a_hugging_face_model_describes_itself():
    facts = resolve_model_facts(tiny_hf_causal_lm("llama"))
    assert facts.blocks == tuple(f"model.layers.{i}" for i in range(len(facts.blocks))) and facts.blocks
    assert (facts.head, facts.embedding) == ("lm_head", "model.embed_tokens")
    assert facts.attention.kind == "hf" and facts.attention.hf_implementation
    assert (facts.token_input, facts.position_input) == ("input_ids", "position_ids")
    assert (facts.num_attention_heads, facts.num_key_value_heads) == (4, 2)
    assert facts.ignore_index == IGNORE_INDEX == -100
    assert facts.source("blocks") == "detected: Hugging Face _no_split_modules"
    assert facts.source("head") == "detected: get_output_embeddings()"
    assert facts.experts == ()


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Module()
        self.attention.inner = _Attention()
        self.ffn = nn.Linear(8, 8)


class _Titanish(nn.Module):
    """A model that says nothing about itself, named as torchtitan names its parts."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(i): _Block() for i in range(3)})
        self.small = nn.ModuleList([nn.Linear(1, 1)])
        self.output = nn.Linear(8, 16, bias=False)


def test_a_model_that_says_nothing_falls_back_to_structure():
    facts = resolve_model_facts(_Titanish())
    assert facts.blocks == ("layers.0", "layers.1", "layers.2")  # the largest list of one class
    assert facts.source("blocks") == "detected: the largest list of same-class modules"
    assert facts.head is None and facts.embedding is None and facts.attention.kind == ""
    assert facts.num_attention_heads is None
    assert resolve_model_facts(nn.Linear(2, 2)).blocks == ()


def test_configured_facts_win_and_say_so():
    config = ModelFactsConfig(blocks=["layers.{0-1}"], head_module="output", embedding_module="tok_embeddings",
                              attention_modules=["layers.*.attention.inner"], token_input="tokens",
                              position_input="positions", ignore_index=-1, num_attention_heads=4,
                              num_key_value_heads=2)
    facts = resolve_model_facts(_Titanish(), config)
    assert facts.blocks == ("layers.0", "layers.1")
    assert (facts.head, facts.embedding) == ("output", "tok_embeddings")
    assert facts.attention.module_names == ("layers.0.attention.inner", "layers.1.attention.inner",
                                            "layers.2.attention.inner")
    assert (facts.token_input, facts.position_input, facts.ignore_index) == ("tokens", "positions", -1)
    assert (facts.num_attention_heads, facts.num_key_value_heads) == (4, 2)
    assert facts.source("head") == "configured: model_facts.head_module"
    assert facts.source("ignore_index") == "configured: model_facts.ignore_index"
    assert [row.label for row in facts.rows()][:2] == ["repeated blocks", "output head"]


def test_a_configured_fact_that_names_nothing_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        resolve_model_facts(_Titanish(), ModelFactsConfig(head_module="lm_head"))
    assert info.value.field == "model_facts.head_module" and "no such module" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve_model_facts(_Titanish(), ModelFactsConfig(attention_function="no_such_pkg.attn"))
    assert info.value.field == "model_facts.attention_function"


class _CountedExperts(nn.Module):
    form = "a toy form: a module with an `experts_weight` [E, H, H] parameter"

    @classmethod
    def detect(cls, module):
        weight = getattr(module, "experts_weight", None)
        return weight.shape[0] if isinstance(weight, nn.Parameter) else None


def test_expert_containers_come_from_the_registered_forms():
    model = nn.Module()
    model.moe = nn.Module()
    model.moe.experts = nn.Module()
    model.moe.experts.experts_weight = nn.Parameter(torch.zeros(4, 2, 2))
    assert resolve_model_facts(model).experts == ()
    add_expert_form(_CountedExperts)
    try:
        facts = resolve_model_facts(model)
    finally:
        remove_expert_form(_CountedExperts)
    assert [(e.name, e.form) for e in facts.experts] == [("moe.experts", "_CountedExperts")]
    configured = resolve_model_facts(model, ModelFactsConfig(expert_modules=["moe.*"]))
    assert [(e.name, e.form) for e in configured.experts] == [("moe.experts", None)]


MOVED = [
    ("tp_plan", TPPlanConfig, "head_module", "output", "model_facts.head_module"),
    ("chunk_loss_plan", ChunkLossPlanConfig, "head_module", "output", "model_facts.head_module"),
    ("chunk_loss_plan", ChunkLossPlanConfig, "ignore_index", -1, "model_facts.ignore_index"),
    ("quantization_plan", QuantizeConfig, "head_module", "output", "model_facts.head_module"),
    ("cp_plan", CPPlanConfig, "attention_function", "pkg.attn", "model_facts.attention_function"),
    ("cp_plan", CPPlanConfig, "attention_modules", ["*.attn"], "model_facts.attention_modules"),
    ("cp_plan", CPPlanConfig, "token_input", "tokens", "model_facts.token_input"),
    ("cp_plan", CPPlanConfig, "position_input", "positions", "model_facts.position_input"),
]


@pytest.mark.parametrize("section,kind,name,value,new_place", MOVED, ids=[f"{m[0]}.{m[2]}" for m in MOVED])
def test_a_removed_field_names_its_new_place(section, kind, name, value, new_place):
    for build in (lambda: FSDPTurboConfig.from_dict({section: {name: value}}), lambda: kind(**{name: value})):
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.field == f"{section}.{name}"
        assert new_place in info.value.fix and "was removed" in str(info.value)


@pytest.mark.parametrize("name", ["swap_activation_force", "swap_optimizer_force"])
def test_the_two_swap_forces_are_one_field(name):
    with pytest.raises(ConfigError) as info:
        FSDPTurboConfig.from_dict({name: True})
    assert info.value.field == name and "swap_force" in info.value.fix
    assert FSDPTurboConfig(swap_force=True).swap_force


class _LogitsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.output = nn.Linear(4, 8)

    def forward(self, tokens):
        return self.output(self.embed(tokens))


def test_lm_loss_takes_the_facts_ignore_index_and_refuses_another():
    torch.manual_seed(0)
    model = FSDPTurbo(FSDPTurboConfig(model_facts={"ignore_index": -1, "head_module": "output"}), _LogitsModel())
    assert model.fsdp_turbo_facts.ignore_index == -1 and model.fsdp_turbo_facts.head == "output"
    tokens = torch.randint(0, 8, (2, 5))
    labels = tokens.clone()
    labels[:, :2] = -1
    expected = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 8), labels.reshape(-1), ignore_index=-1)
    torch.testing.assert_close(lm_loss(model, labels, tokens), expected)
    with pytest.raises(ConfigError) as info:
        lm_loss(model, labels, tokens, ignore_index=-100)
    assert "model_facts.ignore_index" in info.value.fix


def test_an_hf_models_own_loss_ignores_the_facts_label():
    torch.manual_seed(0)
    model = FSDPTurbo(FSDPTurboConfig(model_facts={"ignore_index": -1}), tiny_hf_causal_lm("llama"))
    tokens = torch.randint(0, 64, (2, 9))
    labels = tokens.clone()
    labels[:, :4] = -1  # a prompt: no loss there
    output = model(input_ids=tokens, labels=labels)
    shifted = labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(output.logits[:, :-1].reshape(shifted.numel(), -1).float(), shifted,
                                                 ignore_index=-1)
    torch.testing.assert_close(output.loss, expected)
