"""LoRA layers under tensor parallel, recognised by their shape (this package never imports peft).

PEFT's LoRA layer (``peft.tuners.lora.layer.Linear``) takes the place of an ``nn.Linear`` and
holds it as ``base_layer``; per adapter name ``k`` it holds ``lora_A[k]`` and ``lora_B[k]``
(``nn.Linear``) and ``lora_dropout[k]``. Its forward is
``base_layer(x) + lora_B[k](lora_A[k](lora_dropout[k](x))) * scaling[k]``, so the plan splits
the adapter to end in the base's output layout (``plan.py`` chooses the styles):

* colwise layer: ``lora_A`` replicated on the same replicated input, ``lora_B`` colwise: both
  terms are output-sharded.
* rowwise layer: ``lora_A`` rowwise (its output all-reduced, or reduce-scattered to sequence
  shards under sequence parallel, as the base's is), ``lora_B`` replicated on that output.

The rank ``r`` is never split. What TP cannot reproduce exactly is refused here, by name.
"""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.errors import ConfigError


def _linear_dict(module: nn.Module, name: str) -> bool:
    held = module._modules.get(name)
    return isinstance(held, nn.ModuleDict) and all(isinstance(m, nn.Linear) for m in held.values())


def is_lora_linear(module: nn.Module) -> bool:
    """A LoRA layer over an ``nn.Linear``: ``base_layer`` and ``lora_A`` / ``lora_B`` ModuleDicts
    of ``nn.Linear`` with the same adapter names."""
    if not (isinstance(module._modules.get("base_layer"), nn.Linear)
            and _linear_dict(module, "lora_A") and _linear_dict(module, "lora_B")):
        return False
    return list(module.lora_A.keys()) == list(module.lora_B.keys())


def adapter_names(module: nn.Module) -> tuple[str, ...]:
    return tuple(module.lora_A.keys())


def _variants(module: nn.Module) -> list[str]:
    # DoRA adds a magnitude vector; PEFT records every non-plain LoRA (DoRA, aLoRA, ...) in lora_variant.
    found = {adapter: type(variant).__name__ for adapter, variant in getattr(module, "lora_variant", {}).items()}
    for adapter in getattr(module, "lora_magnitude_vector", {}):
        found.setdefault(adapter, "DoRA (lora_magnitude_vector)")
    return [f"{adapter}: {kind}" for adapter, kind in found.items()]


def _dropping(dropout: nn.Module) -> bool:
    if isinstance(dropout, nn.Identity):
        return False
    return not (isinstance(dropout, nn.modules.dropout._DropoutNd) and dropout.p == 0)


def check_lora_layer(field: str, name: str, module: nn.Module) -> None:
    """Raise a ConfigError unless tensor parallel can split ``module``, a tuner layer the plan
    picked, exactly: plain LoRA over an ``nn.Linear``, with no dropout."""
    leave_out = f"leave {name} out of {field}"
    if not is_lora_linear(module):
        base = type(module._modules["base_layer"]).__name__
        raise ConfigError(field, name, f"{leave_out} (tensor parallel splits LoRA layers over nn.Linear only)",
                          reason=f"{name} is a {type(module).__module__}.{type(module).__name__} tuner layer "
                                 f"(base_layer: {base}), which tensor parallel cannot split")
    variants = _variants(module)
    if variants:
        raise ConfigError(field, name, f"train plain LoRA (use_dora=False, no other LoRA variant) or {leave_out}",
                          reason=f"{name} has LoRA variants {variants}, which tensor parallel cannot split")
    dropping = [f"{adapter}: {type(d).__name__}(p={getattr(d, 'p', '?')})"
                for adapter, d in module.lora_dropout.items() if _dropping(d)]
    if dropping:
        # Each TP rank draws its own mask: on a colwise layer's replicated input the ranks'
        # output shards would come from differently dropped inputs, not from one.
        raise ConfigError(field, name, f"set lora_dropout=0 in the LoraConfig or {leave_out}",
                          reason=f"{name} drops its LoRA input ({', '.join(dropping)}); each tensor-parallel rank "
                                 "would draw its own mask, so the ranks' pieces would not be one dropout of the input")


def lora_sharded_linears(name: str, module: nn.Module, colwise: bool) -> list[tuple[str, nn.Linear]]:
    """The Linear layers of a LoRA layer that TP splits: the base and, per adapter, ``lora_B``
    (colwise, on its output) or ``lora_A`` (rowwise, on its input)."""
    factor = "lora_B" if colwise else "lora_A"
    pieces = [(f"{name}.base_layer", module.base_layer)]
    pieces += [(f"{name}.{factor}.{adapter}", getattr(module, factor)[adapter]) for adapter in adapter_names(module)]
    return pieces
