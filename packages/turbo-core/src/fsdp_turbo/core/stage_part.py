"""A pipeline stage's model: the user's model with the modules other stages hold replaced by
:class:`HeldElsewhere`. Every feature plans such a part as it plans a whole model, from the
same config; since the whole model was planned (and every pattern checked) first, a
pattern that picks nothing on one stage is no error there, and a stand-in is never picked.
Features whose inputs differ by stage read the part's :class:`StageRole` (context parallel:
a later stage's hidden states arrive already cut to this rank's chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

_ROLE = "fsdp_turbo_stage_role"  # set on a stage's root module


@dataclass(frozen=True)
class StageRole:
    first: bool  # holds the embedding: its forward starts from the tokens
    last: bool  # holds the final norm and the head: its forward ends in the loss


class HeldElsewhere(nn.Identity):
    """Stands in for a module another pipeline stage holds; passes its input through (a
    stage that is not last hands on hidden states where the final norm and head would be)."""


def mark_stage_part(model: nn.Module, role: StageRole) -> None:
    setattr(model, _ROLE, role)


def stage_role(model: nn.Module) -> StageRole | None:
    """The pipeline stage ``model`` is, or ``None`` for a whole model."""
    return getattr(model, _ROLE, None)


def is_stage_part(model: nn.Module) -> bool:
    return stage_role(model) is not None


def stage_parts(model: nn.Module) -> list[nn.Module]:
    """The modules holding this rank's share of ``model``: its pipeline stages (the first is
    ``model`` itself), or ``model`` alone. Their parameter names are the whole model's."""
    runner = getattr(model, "fsdp_turbo_pipeline", None)
    return list(runner.parts) if runner is not None else [model]


_inferring = [False]  # set while the pipeline schedule runs a stage only to learn its shapes


@contextmanager
def metadata_inference() -> Iterator[None]:
    """Marks a pass the pipeline schedule runs to learn the shapes its stages exchange (a
    real forward and backward of one micro-batch, before the step's own): what counts
    forwards (MoE telemetry) leaves it out."""
    _inferring[0] = True
    try:
        yield
    finally:
        _inferring[0] = False


def in_metadata_inference() -> bool:
    return _inferring[0]
