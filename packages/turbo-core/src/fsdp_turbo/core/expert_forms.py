"""The registry of expert-container forms: how the model facts recognise MoE experts.

A form's ``detect(module)`` returns expert parallel's adapter when ``module`` is an expert
container of that shape, else ``None``. Expert parallel registers its forms here
(``turbo-distributed``'s ``register_expert_form`` checks they are full adapters first); the
model facts ask the registry which modules are expert containers, so no feature recognises
experts on its own. The registry is the generic :class:`~fsdp_turbo.core.forms.FormRegistry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from fsdp_turbo.core.forms import Form, FormRegistry

ExpertForm = Form

EXPERT_FORMS: FormRegistry[type[Form]] = FormRegistry("expert")


def add_expert_form(cls: type[Form]) -> None:
    """Put ``cls`` first among the forms tried (moving it there if it was registered)."""
    EXPERT_FORMS.add(cls)


def remove_expert_form(cls: type[Form]) -> None:
    """Forget ``cls`` (a no-op if it is not registered)."""
    EXPERT_FORMS.remove(cls)


def registered_expert_forms() -> Sequence[type[Form]]:
    """The registered forms, in the order they are tried."""
    return EXPERT_FORMS.registered()


def recognise_experts(module: nn.Module) -> tuple[type[Form], Any] | None:
    """``(form, what its detect returned)`` of the first form that recognises ``module``."""
    return EXPERT_FORMS.recognise(module)
