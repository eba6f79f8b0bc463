"""Cases trained in a few launches, one per world size ("2 ranks", "4 ranks"): each launch runs
on one pytest worker (its xdist group) and once, by the first of its tests that worker runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def world_of(group: str) -> int:
    """The ranks of a launch named like "4 ranks"."""
    return int(group.split()[0])


def grouped_cases(launches: dict[str, list[str]], prefix: str, keep: Callable[[str], bool]) -> list:
    """``(group, case)`` parameters of the cases ``keep`` takes, each marked with its launch's xdist group."""
    return [pytest.param(group, name, id=name, marks=pytest.mark.xdist_group(f"{prefix}_{world_of(group)}"))
            for group, names in launches.items() for name in names if keep(name)]


def launched(done: dict[str, Any], group: str, launch: Callable[[str], Any]) -> Any:
    """``launch(group)``'s result, made once per worker (``done`` is a module fixture's dict)."""
    if group not in done:
        done[group] = launch(group)
    return done[group]
