"""One registry of *forms*: the shapes of a kind of module a feature knows how to handle.

Expert containers (``core.expert_forms``) and linear-attention layers
(``core.families.linear_forms``) each keep one :class:`FormRegistry`. A form is a class
with a ``form`` description (named in errors) and a ``detect(module)`` classmethod that
returns something truthy (an adapter, or ``True``) when ``module`` has that shape, else
``None`` or ``False``. Newest first: a form registered later is asked first, so it may
take over a module a built-in one also matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from torch import nn


class Form(Protocol):
    form: str  # a description, named in errors for a module no form recognises

    @classmethod
    def detect(cls, module: nn.Module) -> Any: ...


F = TypeVar("F")


class FormRegistry(Generic[F]):
    """The registered forms of one kind, in the order they are tried."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # what the forms recognise, for messages ("expert", "linear-attention")
        self._forms: list[F] = []

    def add(self, cls: F) -> F:
        """Put ``cls`` first among the forms tried (moving it there if it was registered)."""
        self.remove(cls)
        self._forms.insert(0, cls)
        return cls

    def remove(self, cls: F) -> None:
        """Forget ``cls`` (a no-op if it is not registered)."""
        if cls in self._forms:
            self._forms.remove(cls)

    def registered(self) -> Sequence[F]:
        return tuple(self._forms)

    def recognise(self, module: nn.Module) -> tuple[F, Any] | None:
        """``(form, what its detect returned)`` of the first form that recognises ``module``."""
        for form in self._forms:
            found = form.detect(module)  # type: ignore[attr-defined]
            if found is not None and found is not False:
                return form, found
        return None

    def descriptions(self) -> str:
        """Every form's description, for the error about a module none recognises."""
        return "; or ".join(getattr(form, "form", repr(form)) for form in self._forms)


def class_names(module: nn.Module) -> set[str]:
    """The names of ``module``'s class and its bases: facts name classes by name, so that
    turbo-core never imports transformers, and a subclass of a known class counts."""
    return {klass.__name__ for klass in type(module).__mro__}
