"""The ``attention kinds`` block of ``fsdp-turbo plan``: each kind of token mixer the model
facts name (softmax, sliding window, chunked, linear, sparse, compressed), its modules, and
under each what the plans say they do with it (their ``describe()`` rows for that kind).

Pure: it reads the model facts and the plans, and imports no feature package (the plan
command shows, it does not plan).
"""

from __future__ import annotations

from collections.abc import Iterable

from fsdp_turbo.cli.names import compress_names
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow

PER_HEAD = "per-head parameters"  # the rows about the parameters attentions hold per head (sinks)


def _header(facts: ModelFacts, kind: str) -> str:
    layers = facts.layers_of(kind)
    names = [layer.name for layer in layers]
    extra = ""
    windows = sorted({layer.window for layer in layers if layer.window})
    chunks = sorted({layer.chunk for layer in layers if layer.chunk})
    if windows:
        extra = f", window {', '.join(map(str, windows))}"
    if chunks:
        extra = f", chunk {', '.join(map(str, chunks))}"
    forms = sorted({layer.form.form for layer in layers if layer.form is not None})
    if forms:
        extra += f", {'; '.join(forms)}"
    declared = sorted({layer.declared for layer in layers if layer.declared and kind == "unknown"})
    if declared:
        extra += f", declared {', '.join(declared)}"
    return f"  {kind}: {', '.join(compress_names(names))} ({len(names)}{extra})"


def kind_rows(plans: Iterable[FeaturePlan]) -> list[PlanRow]:
    """Every plan's rows about an attention kind, in plan order."""
    return [row for plan in plans for row in plan.describe() if row.kind]


def attention_lines(facts: ModelFacts, plans: Iterable[FeaturePlan]) -> list[str]:
    """One header per kind the model holds (``compress_names`` folds numbered names), then the
    plans' rows about it; a kind no enabled feature changes says so."""
    if not facts.attention_layers:
        return ["attention kinds: none found (no module class named ...Attention, a family's attention class or "
                "a linear-attention form)"]
    rows = kind_rows(plans)
    lines = ["attention kinds:"]
    kinds = list(dict.fromkeys(layer.kind.value for layer in facts.attention_layers))
    if facts.head_parameters:
        kinds.append(PER_HEAD)
    for kind in kinds:
        if kind == PER_HEAD:
            names = [f"{p.module}.{p.parameter}" for p in facts.head_parameters]
            whats = sorted({p.what for p in facts.head_parameters})
            lines.append(f"  {kind}: {', '.join(compress_names(names))} ({len(names)}, {'; '.join(whats)})")
        else:
            lines.append(_header(facts, kind))
        mine = [row for row in rows if row.kind == kind]
        lines += [f"    {row.label}: {', '.join(compress_names(list(row.names)))}" for row in mine]
        if not mine:
            lines.append("    no enabled feature splits it")
    return lines
