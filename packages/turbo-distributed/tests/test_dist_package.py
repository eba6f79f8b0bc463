"""turbo-distributed's packaging: version, namespace layout, dependency rule, entry point."""

from fsdp_turbo.core.plugin import TransformRegistry
from fsdp_turbo.core.testing.imports import feature_package_problems
from fsdp_turbo.distributed.fully_shard_parallel import FullyShardTransform


def test_packaging_rules():
    assert feature_package_problems("turbo-distributed", "fsdp_turbo.distributed") == []


def test_fully_shard_transform_is_registered_by_entry_point():
    assert isinstance(TransformRegistry().get("fully_shard"), FullyShardTransform)
