"""turbo-memory's packaging: version, namespace layout and the dependency rule."""

from fsdp_turbo.core.testing.imports import feature_package_problems


def test_packaging_rules():
    assert feature_package_problems("turbo-memory", "fsdp_turbo.memory") == []
