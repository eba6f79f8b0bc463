"""turbo-memory's packaging (version, namespace layout, dependency rule), and the facade's
error while its transform is not built yet."""

import pytest
from torch import nn

from fsdp_turbo.core.testing.imports import feature_package_problems
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import ConfigError


def test_packaging_rules():
    assert feature_package_problems("turbo-memory", "fsdp_turbo.memory") == []


def test_unbuilt_feature_is_a_clear_config_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as info:
        FSDPTurbo({"recompute": True}, nn.Linear(2, 2))
    assert info.value.field == "recompute"
    assert "turbo-memory" in str(info.value) and "installed but has no" in str(info.value)
