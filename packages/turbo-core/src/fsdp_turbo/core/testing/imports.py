"""Check a package's dependency rule by reading its source (no import needed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# What every FSDPTurbo feature package may import besides itself.
SHARED_ALLOWED = ("torch", "fsdp_turbo.core", "fsdp_turbo.fsdp_turbo_config", "fsdp_turbo.fsdp_turbo")


def imported_names(source_dir: str | Path) -> dict[str, set[str]]:
    """Absolute module names imported by each ``.py`` file under ``source_dir``."""
    found: dict[str, set[str]] = {}
    for path in sorted(Path(source_dir).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        found[str(path)] = names
    return found


def foreign_imports(source_dir: str | Path, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Imports that are neither the standard library nor under one of ``allowed``."""

    def ok(name: str) -> bool:
        if name.split(".")[0] in sys.stdlib_module_names or name == "__future__":
            return True
        return any(name == prefix or name.startswith(prefix + ".") for prefix in allowed)

    bad = {path: sorted(n for n in names if not ok(n)) for path, names in imported_names(source_dir).items()}
    return {path: names for path, names in bad.items() if names}
