"""``module_patches``: members replaced by pattern before anything is planned, validated like
every other section; and a family's own patches. Single process."""

import pytest
import torch

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.families import Family, MemberPatch, register_family, unregister_family
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

pytest.importorskip("transformers")
CALLS: list[str] = []
MLP = "transformers.models.llama.modeling_llama.LlamaMLP.forward"


def counted_forward(self, x):
    """What LlamaMLP computes, counting its calls."""
    CALLS.append(type(self).__name__)
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _ids():
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def test_a_patch_by_pattern_replaces_only_the_picked_instances():
    CALLS.clear()
    plain = tiny_hf_causal_lm("llama")
    expected = plain(input_ids=_ids()).logits
    patch = {"target": MLP, "replacement": f"{__name__}.counted_forward", "modules": ["model.layers.1.mlp"]}
    model = FSDPTurbo({"module_patches": [patch]}, tiny_hf_causal_lm("llama"))
    torch.testing.assert_close(model(input_ids=_ids()).logits, expected)
    assert CALLS == ["PatchedLlamaMLP"]  # layer 1 only; the class mixed into LlamaMLP
    CALLS.clear()
    model = FSDPTurbo({"module_patches": [{**patch, "modules": None}]}, tiny_hf_causal_lm("llama"))
    model(input_ids=_ids())
    assert CALLS == ["PatchedLlamaMLP", "PatchedLlamaMLP"]


def test_the_section_is_validated_like_the_others():
    with pytest.raises(ConfigError, match=r"module_patches\[0\]\.replacement") as caught:
        FSDPTurboConfig.from_dict({"module_patches": [{"target": MLP, "replacement": "no_dots"}]})
    assert "dotted path" in caught.value.fix
    with pytest.raises(ConfigError, match=r"module_patches\[1\]\.modules"):
        FSDPTurboConfig.from_dict({"module_patches": [{"target": MLP, "replacement": "a.b"},
                                                      {"target": MLP, "replacement": "a.b", "modules": [3]}]})
    with pytest.raises(ConfigError, match="module_patches"):
        FSDPTurboConfig.from_dict({"module_patches": {"target": MLP}})
    with pytest.raises(ConfigError, match=r"module_patches\[0\]\.target='.*no_member'"):
        FSDPTurbo({"module_patches": [{"target": MLP.replace("forward", "no_member"),
                                       "replacement": f"{__name__}.counted_forward"}]}, tiny_hf_causal_lm("llama"))


def test_a_family_patch_applies_before_the_facts():
    CALLS.clear()
    register_family(Family(name="patched", patches=(MemberPatch("LlamaMLP", "forward", counted_forward, "test"),)))
    try:
        model = FSDPTurbo({}, tiny_hf_causal_lm("llama"))
        model(input_ids=_ids())
    finally:
        unregister_family("patched")
    assert CALLS == ["PatchedLlamaMLP", "PatchedLlamaMLP"]
