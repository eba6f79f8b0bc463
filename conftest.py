"""Shared by every test session: test modules marked ``rank_pool`` run their distributed
calls on one pool of ranks (``fsdp_turbo.core.testing.pytest_plugin``)."""

pytest_plugins = ["fsdp_turbo.core.testing.pytest_plugin"]
