"""The transform plugin interface and its registry.

Every feature is a :class:`Transform`. Packages register theirs through the
entry-point group ``fsdp_turbo.transforms``; the core never imports a feature
package by name.
"""

from __future__ import annotations

import abc
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

ENTRY_POINT_GROUP = "fsdp_turbo.transforms"


class Stage:
    """Pipeline positions; lower runs first. Gaps leave room for third-party transforms."""

    QUANTIZE = 100
    TENSOR_PARALLEL = 200
    EXPERT_PARALLEL = 300
    CONTEXT_PARALLEL = 400
    RECOMPUTE = 500
    CHUNK_LOSS = 550
    SWAP_ACTIVATION = 600
    COMPILE = 650
    FULLY_SHARD = 700
    OPTIMIZER_HOOKS = 800


class Transform(abc.ABC):
    """One feature applied to the model by the facade.

    ``validate`` must raise ``ConfigError`` for every bad input and must not
    communicate; ``apply`` may. Both see the same parallel state on every rank.
    """

    name: str = ""
    stage: int = 0

    @abc.abstractmethod
    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool: ...

    @abc.abstractmethod
    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None: ...

    @abc.abstractmethod
    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, stage={self.stage})"


class TransformRegistry:
    """Transforms by name: those from entry points plus any registered in code."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._manual: dict[str, Transform] = {}
        self._loaded: dict[str, Transform] | None = None if load_entry_points else {}

    def register(self, transform: Transform) -> None:
        if not transform.name:
            raise ValueError(f"{transform!r} has no name")
        self._manual[transform.name] = transform

    def unregister(self, name: str) -> None:
        self._manual.pop(name, None)

    def _from_entry_points(self) -> dict[str, Transform]:
        if self._loaded is None:
            found: dict[str, Transform] = {}
            for point in entry_points(group=ENTRY_POINT_GROUP):
                factory = point.load()
                transform = factory() if isinstance(factory, type) else factory
                if not isinstance(transform, Transform):
                    raise TypeError(f"entry point {point.name!r} gives {transform!r}, not a Transform")
                found[transform.name] = transform
            self._loaded = found
        return self._loaded

    def get(self, name: str) -> Transform | None:
        return self._manual.get(name) or self._from_entry_points().get(name)

    def all(self) -> list[Transform]:
        merged = {**self._from_entry_points(), **self._manual}
        return sorted(merged.values(), key=lambda t: (t.stage, t.name))


registry = TransformRegistry()
