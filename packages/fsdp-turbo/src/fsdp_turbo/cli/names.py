"""Module names folded for display: one line per numbered family of modules, shared by the
plan's sections (the feature rows and the attention kinds)."""

from __future__ import annotations

import re
from collections import defaultdict


def compress_names(names: list[str]) -> list[str]:
    """``model.layers.0.mlp``, ``model.layers.1.mlp`` -> ``model.layers.{0-1}.mlp``."""
    groups: dict[str, list[int]] = defaultdict(list)
    singles = []
    for name in names:
        numbers = re.findall(r"(?<=\.)\d+(?=\.|$)", name)
        if len(numbers) != 1:
            singles.append(name)
            continue
        groups[re.sub(r"(?<=\.)\d+(?=\.|$)", "{}", name)].append(int(numbers[0]))
    out = []
    for template, indices in groups.items():
        indices = sorted(indices)
        contiguous = indices == list(range(indices[0], indices[-1] + 1))
        spec = f"{indices[0]}-{indices[-1]}" if contiguous and len(indices) > 1 else ",".join(map(str, indices))
        out.append(template.replace("{}", "{" + spec + "}"))
    return out + singles
