"""``fsdp_plan.hook_modules``: one gathering point per block.

The upstream's own FSDP registers a unit's forward hooks on an enclosing "hook module"
(typically the decoder layer), so every unit inside a layer all-gathers when the layer
starts. torch's ``fully_shard`` keeps its hooks on the unit itself; the same schedule
comes from a forward pre-hook on the hook module that issues ``unshard(async_op=True)``
for each unit inside it, in model order. Each unit's own pre-forward then waits on the
all-gather already in flight instead of starting it. Numbers do not change; the
all-gathers of a block are all issued when it begins (the attention's and the experts'
together), so the experts' all-gather overlaps the attention's compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_turbo.core.patterns import match_modules


def _units_inside(hook_module: nn.Module, units: Iterable[nn.Module]) -> list[FSDPModule]:
    wanted = {id(unit) for unit in units}
    return [m for m in hook_module.modules() if id(m) in wanted and isinstance(m, FSDPModule)]


def gather_at_hook_modules(model: nn.Module, patterns: Sequence[str], units: Iterable[nn.Module],
                           field: str = "fsdp_plan.hook_modules") -> list[RemovableHandle]:
    """Make every FSDP unit of ``units`` inside a module ``patterns`` pick all-gather when that
    module's forward starts. Returns the hooks' handles (one a hook module holding units)."""
    if not patterns:
        return []
    units = list(units)
    handles = []
    for hook_module in match_modules(model, patterns, field=field, outermost=True).values():
        # a hook module that is a unit itself gathers in its own pre-forward, which runs first
        inside = [unit for unit in _units_inside(hook_module, units) if unit is not hook_module]
        if inside:
            handles.append(hook_module.register_forward_pre_hook(_unshard_all(inside)))
    return handles


def _unshard_all(units: list[FSDPModule]):
    def pre_forward(_module: nn.Module, _args: tuple) -> None:
        for unit in units:
            unit.unshard(async_op=True)  # the unit's own pre-forward waits on it
    return pre_forward
