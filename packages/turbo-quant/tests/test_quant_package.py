"""turbo-quant's packaging: version, namespace layout, and the dependency rule."""

from importlib.metadata import version
from pathlib import Path

import fsdp_turbo.quantization as package
from fsdp_turbo.core.testing.imports import SHARED_ALLOWED, foreign_imports

SOURCE = Path(package.__file__).resolve().parent


def test_version_is_the_package_version():
    assert version("turbo-quant") == package.__version__


def test_ships_no_namespace_init():
    assert not (SOURCE.parent / "__init__.py").exists()


def test_imports_only_torch_and_turbo_core():
    assert foreign_imports(SOURCE, (*SHARED_ALLOWED, "fsdp_turbo.quantization")) == {}


def test_unbuilt_feature_is_a_clear_config_error(monkeypatch):
    # The transform lands with its feature issue; until then the facade must say so.
    import pytest
    from torch import nn

    from fsdp_turbo.fsdp_turbo import FSDPTurbo
    from fsdp_turbo.fsdp_turbo_config import ConfigError, FSDPTurboConfig

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as info:
        FSDPTurbo(FSDPTurboConfig.from_dict({"quantization_plan": {}}), nn.Linear(2, 2))
    assert info.value.field == "quantization_plan"
    assert "turbo-quant" in str(info.value) and "installed but has no" in str(info.value)
