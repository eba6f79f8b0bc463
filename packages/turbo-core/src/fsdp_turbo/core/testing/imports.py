"""Check a package's dependency rule by reading its source (no import needed)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# What every FSDPTurbo feature package may import besides itself.
# turbo-core's modules a feature package may use (the op registry and its gated delta rule ops are turbo-core's).
SHARED_ALLOWED = ("torch", "fsdp_turbo.core", "fsdp_turbo.fsdp_turbo_config", "fsdp_turbo.fsdp_turbo",
                  "fsdp_turbo.ops.registry", "fsdp_turbo.ops.fla")
# Device libraries, which only device backends (files under an ``ops/`` folder) may import.
DEVICE_LIBRARIES = ("torch_npu", "triton")


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


def foreign_imports(source_dir: str | Path, allowed: tuple[str, ...], *,
                    device_backends: bool = False) -> dict[str, list[str]]:
    """Imports that are neither the standard library nor under one of ``allowed`` (with
    ``device_backends``, files under an ``ops/`` folder may also import device libraries)."""

    def ok(name: str, path: str) -> bool:
        if name.split(".")[0] in sys.stdlib_module_names or name == "__future__":
            return True
        in_backend = device_backends and "ops" in Path(path).relative_to(source_dir).parts
        prefixes = (*allowed, *DEVICE_LIBRARIES) if in_backend else allowed
        return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)

    bad = {path: sorted(n for n in names if not ok(n, path)) for path, names in imported_names(source_dir).items()}
    return {path: names for path, names in bad.items() if names}


def feature_package_problems(distribution: str, module: str) -> list[str]:
    """What breaks the packaging rules for a feature package: its version must be the
    installed distribution's, it must not ship the namespace ``__init__``, and it may
    import only the standard library, torch, turbo-core and itself (its ``ops/`` device
    backends also ``torch_npu`` and ``triton``)."""
    import importlib
    from importlib.metadata import version

    package = importlib.import_module(module)
    source = Path(package.__file__).resolve().parent
    problems = []
    if version(distribution) != package.__version__:
        problems.append(f"{module}.__version__={package.__version__} but {distribution} is {version(distribution)}")
    if (source.parent / "__init__.py").exists():
        problems.append(f"{source.parent / '__init__.py'} closes the fsdp_turbo namespace")
    for path, names in foreign_imports(source, (*SHARED_ALLOWED, module), device_backends=True).items():
        problems.append(f"{path} imports {names}")
    return problems


def module_sources(src_dirs: list[str | Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under each ``src`` dir (a package's
    ``__init__`` is named as the package)."""
    modules = {}
    for src in map(Path, src_dirs):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which of ``modules`` each one imports, type-checking and function-level imports
    included. ``from a.b import c`` points at ``a.b.c`` when that is a module, else ``a.b``."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles
