"""The optimizer's ``state`` mapping, made to tell the swapper which group a step touches.

Built-in optimizers read ``self.state[p]`` group by group, right before updating
that group; a lookup is therefore the moment to make that group's states resident
and to start copying the next group in. Iteration (``items()``, as ``state_dict()``
uses) does not swap: between steps it sees the host values.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping
from typing import Any, Protocol


class Toucher(Protocol):
    """What the map tells of each lookup (the ``Toucher``)."""

    def touch(self, key: Hashable) -> None: ...


class SwapStateMap(defaultdict):
    """A ``defaultdict(dict)`` whose lookups call ``swapper.touch(key)``.

    The swapper is an instance attribute that copies and pickles do not carry, so a
    ``copy.deepcopy(optimizer.state)`` is an ordinary mapping of host values.
    """

    _swapper: Toucher | None = None

    @classmethod
    def wrap(cls, state: Mapping, swapper: Toucher) -> SwapStateMap:
        wrapped = cls(getattr(state, "default_factory", None) or dict, state)
        wrapped._swapper = swapper
        return wrapped

    def __getitem__(self, key: Hashable) -> Any:
        if self._swapper is not None:
            self._swapper.touch(key)
        return super().__getitem__(key)

    def get(self, key: Hashable, default: Any = None) -> Any:
        if self._swapper is not None:
            self._swapper.touch(key)
        return super().get(key, default)

    def setdefault(self, key: Hashable, default: Any = None) -> Any:
        if self._swapper is not None:
            self._swapper.touch(key)
        return super().setdefault(key, default)

    def peek(self, key: Hashable) -> dict | None:
        """The entry for ``key`` without swapping anything in or creating it."""
        return dict.get(self, key)
