"""The registry of expert-container forms: how the model facts recognise MoE experts.

A form is a class with a ``form`` description and a ``detect(module)`` classmethod that
returns something (expert parallel's adapter) when ``module`` is an expert container of
that shape, else ``None``. Expert parallel registers its forms here (``turbo-distributed``'s
``register_expert_form`` checks they are full adapters first); the model facts ask the
registry which modules are expert containers, so no feature recognises experts on its own.
Newest first: a form registered later may take over a module a built-in one also matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn


class ExpertForm(Protocol):
    form: str  # a description, named in errors for a module no form recognises

    @classmethod
    def detect(cls, module: nn.Module) -> Any | None: ...


_FORMS: list[type[ExpertForm]] = []


def add_expert_form(cls: type[ExpertForm]) -> None:
    """Put ``cls`` first among the forms tried (moving it there if it was registered)."""
    remove_expert_form(cls)
    _FORMS.insert(0, cls)


def remove_expert_form(cls: type[ExpertForm]) -> None:
    """Forget ``cls`` (a no-op if it is not registered)."""
    if cls in _FORMS:
        _FORMS.remove(cls)


def registered_expert_forms() -> Sequence[type[ExpertForm]]:
    """The registered forms, in the order they are tried."""
    return tuple(_FORMS)


def recognise_experts(module: nn.Module) -> tuple[type[ExpertForm], Any] | None:
    """``(form, what its detect returned)`` of the first form that recognises ``module``."""
    for form in _FORMS:
        found = form.detect(module)
        if found is not None:
            return form, found
    return None
