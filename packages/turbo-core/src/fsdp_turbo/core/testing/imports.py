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


def feature_package_problems(distribution: str, module: str) -> list[str]:
    """What breaks the packaging rules for a feature package: its version must be the
    installed distribution's, it must not ship the namespace ``__init__``, and it may
    import only the standard library, torch, turbo-core and itself."""
    import importlib
    from importlib.metadata import version

    package = importlib.import_module(module)
    source = Path(package.__file__).resolve().parent
    problems = []
    if version(distribution) != package.__version__:
        problems.append(f"{module}.__version__={package.__version__} but {distribution} is {version(distribution)}")
    if (source.parent / "__init__.py").exists():
        problems.append(f"{source.parent / '__init__.py'} closes the fsdp_turbo namespace")
    for path, names in foreign_imports(source, (*SHARED_ALLOWED, module)).items():
        problems.append(f"{path} imports {names}")
    return problems
