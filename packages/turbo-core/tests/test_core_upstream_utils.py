"""The upstream module-level helpers clients import by path: ``fsdp_turbo.utils.str_match``
and ``fsdp_turbo.utils.patch``."""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.utils.patch import patch_model_members
from fsdp_turbo.utils.str_match import module_name_match


@pytest.mark.parametrize("pattern,name,expected", [
    ("model.layers.{*}.mlp.experts", "model.layers.3.mlp.experts", True),
    ("model.layers.{*}.mlp.experts", "model.layers.x.mlp.experts", False),
    ("model.layers.{*}.mlp.experts", "model.layers.3.mlp.experts.0", False),  # a whole-name match
    ("model.layers.{*}.mlp", "model.layers.12.mlp", True),
    ("model.layers.{0-1}.mlp", "model.layers.2.mlp", False),
    ("*.q_proj", "model.layers.0.self_attn.q_proj", True),  # * crosses dots
    ("model.layers.?.mlp", "model.layers.7.mlp", True),
    ("model.layers.?.mlp", "model.layers.17.mlp", False),
])
def test_module_name_match_is_the_plan_matcher(pattern, name, expected):
    assert module_name_match(pattern, name) is expected


class Gate(nn.Module):
    calls = 0

    def __init__(self, scale: float):
        super().__init__()
        self._scale = scale

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = value

    @classmethod
    def kind(cls) -> str:
        return cls.__name__

    @staticmethod
    def offset() -> float:
        return 0.0

    def forward(self, x):
        return x * self.scale + self.offset()


def _model():
    return nn.Sequential(Gate(2.0), nn.Linear(3, 3), Gate(3.0))


def test_a_method_is_replaced_on_the_models_instances_only():
    model, outside = _model(), Gate(5.0)
    seen = []

    def forward(self, x):
        seen.append(self)
        return x + self.scale

    assert patch_model_members(model, f"{__name__}.Gate.forward", forward) == 2
    x = torch.ones(3)
    torch.testing.assert_close(model[0](x), x + 2.0)
    assert seen == [model[0]]  # bound to the module it serves
    torch.testing.assert_close(outside(x), x * 5.0)  # another model's Gate is untouched
    assert patch_model_members(model, f"{__name__}.Gate.forward", forward) == 2  # again: a no-op
    model[2](x)
    assert seen == [model[0], model[2]]  # called once, not wrapped twice


def test_static_class_and_callable_members_keep_their_binding():
    model = _model()
    assert patch_model_members(model, [f"{__name__}.Gate.offset", f"{__name__}.Gate.kind"],
                               [lambda: 1.0, lambda cls: "patched " + cls.__name__]) == 4
    torch.testing.assert_close(model[0](torch.zeros(2)), torch.ones(2))
    assert model[2].kind() == "patched Gate" and Gate.kind() == "Gate"


def test_a_property_getter_is_replaced_on_its_class_and_keeps_its_setter():
    class Local(Gate):
        pass

    model = nn.Sequential(Local(2.0))
    Local.__module__ = __name__
    globals()["Local"] = Local
    original = Gate.__dict__["scale"]
    try:
        assert patch_model_members(model, f"{__name__}.Local.scale", lambda self: self._scale * 10) == 1
        assert model[0].scale == 20.0
        model[0].scale = 4.0
        assert model[0].scale == 40.0
        assert Gate(1.0).scale == 10.0  # the property lives on Gate, so every Gate sees the new getter
    finally:
        Gate.scale = original
        del globals()["Local"]
    assert Gate(1.0).scale == 1.0


def rectified_forward(self, x):
    return torch.relu(x)


def test_a_replacement_by_dotted_path_and_torch_classes():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert patch_model_members(model, "torch.nn.Linear.forward", f"{__name__}.rectified_forward") == 2
    torch.testing.assert_close(model[0](torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    assert nn.Linear(2, 2).forward.__func__ is nn.Linear.forward  # the class itself is untouched


@pytest.mark.parametrize("targets,replacements,field", [
    ("Gate.forward", len, "targets"),  # no module before the class
    (f"{__name__}.NoSuchClass.forward", len, "targets"),
    (f"{__name__}.Gate._scale_missing", len, "targets"),
    ([f"{__name__}.Gate.forward", f"{__name__}.Gate.kind"], [len, len, len], "replacements"),
    (f"{__name__}.Gate.forward", "not_a_path", "replacements"),
    ([], len, "targets"),
])
def test_bad_targets_and_replacements_name_the_argument(targets, replacements, field):
    with pytest.raises(ConfigError) as info:
        patch_model_members(_model(), targets, replacements)
    assert info.value.field == field
