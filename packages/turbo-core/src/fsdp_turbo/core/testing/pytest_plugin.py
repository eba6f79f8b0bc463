"""pytest wiring for :mod:`.pool`: the tests of a module marked ``rank_pool`` run their
distributed calls on pool ranks, one pool per world size, kept for the whole session (one
set per xdist worker) and stopped at its end. Other modules' calls get ranks of their own.

Load it with ``pytest_plugins = ["fsdp_turbo.core.testing.pytest_plugin"]`` in the root
``conftest.py``. ``--no-rank-pool`` gives every call its own ranks again (to rule the pool
out when a test misbehaves)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fsdp_turbo.core.testing.pool import RankPool, pooled_ranks


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-rank-pool", action="store_true",
                     help="run every distributed call on ranks of its own, not on the session's rank pools")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "rank_pool: the module's run_distributed calls run on the session's rank pools")


@pytest.fixture(scope="session")
def _session_rank_pools() -> Iterator[dict[int, RankPool]]:
    pools: dict[int, RankPool] = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module", autouse=True)
def _module_rank_pool(request: pytest.FixtureRequest, _session_rank_pools: dict[int, RankPool]) -> Iterator[None]:
    if request.node.get_closest_marker("rank_pool") is None or request.config.getoption("--no-rank-pool"):
        yield
        return
    with pooled_ranks(_session_rank_pools):
        yield
