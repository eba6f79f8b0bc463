"""turbo-distributed's packaging: version, namespace layout, and the dependency rule."""

from importlib.metadata import version
from pathlib import Path

import fsdp_turbo.distributed as package
from fsdp_turbo.core.testing.imports import SHARED_ALLOWED, foreign_imports

SOURCE = Path(package.__file__).resolve().parent


def test_version_is_the_package_version():
    assert version("turbo-distributed") == package.__version__


def test_ships_no_namespace_init():
    assert not (SOURCE.parent / "__init__.py").exists()


def test_imports_only_torch_and_turbo_core():
    assert foreign_imports(SOURCE, (*SHARED_ALLOWED, "fsdp_turbo.distributed")) == {}


def test_fully_shard_transform_is_registered_by_entry_point():
    from fsdp_turbo.core.plugin import TransformRegistry
    from fsdp_turbo.distributed.fully_shard_parallel import FullyShardTransform

    assert isinstance(TransformRegistry().get("fully_shard"), FullyShardTransform)
