"""All packages installed together: one namespace, every transform found, versions independent."""

import importlib
from importlib.metadata import entry_points, version

import pytest
from torch import nn

import fsdp_turbo
from fsdp_turbo.core.plugin import ENTRY_POINT_GROUP, TransformRegistry
from fsdp_turbo.fsdp_turbo_config import ConfigError

SUBPACKAGES = {
    "turbo-core": "fsdp_turbo.core",
    "turbo-distributed": "fsdp_turbo.distributed",
    "turbo-memory": "fsdp_turbo.memory",
    "turbo-quant": "fsdp_turbo.quantization",
    "fsdp-turbo": "fsdp_turbo.cli",
}


def test_one_namespace_from_five_distributions():
    assert getattr(fsdp_turbo, "__file__", None) is None
    for dist, module in SUBPACKAGES.items():
        assert importlib.import_module(module).__version__ == version(dist)


def test_every_entry_point_is_a_registered_transform():
    names = {point.name for point in entry_points(group=ENTRY_POINT_GROUP)}
    registry = TransformRegistry()
    assert "fully_shard" in names
    assert {t.name for t in registry.all()} == names


def test_meta_package_requires_every_package():
    from importlib.metadata import requires

    required = {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requires("fsdp-turbo")}
    assert {"turbo-core", "turbo-distributed", "turbo-memory", "turbo-quant"} <= required


def test_missing_transform_names_its_installed_package():
    # A feature package that is installed but lacks the transform (an older release).
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo import plan_transforms
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    config = FSDPTurboConfig(recompute=True)
    state = ParallelState.create(config.validate(1), 0, "cpu")
    with pytest.raises(ConfigError) as info:
        plan_transforms(config, nn.Linear(2, 2), state, transforms=TransformRegistry(load_entry_points=False))
    assert info.value.field == "recompute"
    assert "turbo-memory" in str(info.value) and "installed but has no" in str(info.value)


def test_feature_transforms_are_registered():
    names = {t.name for t in TransformRegistry().all()}
    assert {"recompute", "chunk_loss", "swap_activation", "swap_optimizer", "quantize"} <= names
