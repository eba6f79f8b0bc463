"""Shared by every test session: test modules marked ``rank_pool`` run their distributed
calls on one pool of ranks (``fsdp_turbo.core.testing.pytest_plugin``); where the session asks
for it (``nox`` does), a skipped test fails the session (``fsdp_turbo.core.testing.skips``);
``pytester`` runs the plugins' own tests."""

pytest_plugins = ["fsdp_turbo.core.testing.pytest_plugin", "fsdp_turbo.core.testing.skips", "pytester"]
