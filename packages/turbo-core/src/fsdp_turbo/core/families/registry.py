"""The registered families. A family file registers its :class:`Family` when imported; a
user registers the facts of a model the library does not know the same way::

    from fsdp_turbo.core.families import Family, HeadParameter, LatentModule, register_family

    register_family(Family(name="my-model", head_parameters=(HeadParameter("MyAttention", "sinks"),),
                           latent_modules=(LatentModule("MyAttention", "kv_latent"),),
                           routers=("MyRouter",)))

Module facts (per class) of every registered family apply to any model that holds such a
module; model facts (layer kinds, sizes) apply to models whose ``config.model_type`` the
family lists.
"""

from __future__ import annotations

from typing import Any

from fsdp_turbo.core.families.facts import Family
from fsdp_turbo.core.families.linear_forms import LINEAR_ATTENTION_FORMS

_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` (replacing one of the same name) and its linear-attention forms."""
    if not isinstance(family, Family) or not family.name:
        raise TypeError(f"register a Family(name=...), not {family!r}")
    old = _FAMILIES.pop(family.name, None)
    if old is not None:
        for form in old.linear_attention:
            LINEAR_ATTENTION_FORMS.remove(form)
    _FAMILIES[family.name] = family
    for form in family.linear_attention:
        LINEAR_ATTENTION_FORMS.add(form)
    return family


def unregister_family(name: str) -> None:
    """Forget the family ``name`` and its forms (a no-op if it is not registered)."""
    family = _FAMILIES.pop(name, None)
    for form in family.linear_attention if family else ():
        LINEAR_ATTENTION_FORMS.remove(form)


def families() -> tuple[Family, ...]:
    """The registered families, in registration order."""
    return tuple(_FAMILIES.values())


def family_for(config: Any) -> Family | None:
    """The family whose ``model_types`` holds ``config.model_type``, else ``None``."""
    model_type = getattr(config, "model_type", None)
    return next((f for f in _FAMILIES.values() if model_type and model_type in f.model_types), None)
