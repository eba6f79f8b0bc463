"""The architecture, checked by reading the source: no import circles anywhere,
``fsdp-turbo plan`` reaches no feature package, and the helpers two packages need exist
once, in turbo-core."""

import ast
from pathlib import Path

from fsdp_turbo.core.testing.imports import import_cycles, import_graph, module_sources

ROOT = Path(__file__).resolve().parents[1]
SOURCES = module_sources(sorted(ROOT.glob("packages/*/src")))
FEATURE_PACKAGES = ("fsdp_turbo.distributed", "fsdp_turbo.memory", "fsdp_turbo.quantization")
MODEL_INSPECT = "fsdp_turbo.core.model_inspect"


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_the_sources_were_found():
    assert {"fsdp_turbo.cli.plan", MODEL_INSPECT, "fsdp_turbo.distributed.tensor_parallel.plan",
            "fsdp_turbo.memory.swap_activation.mover", "fsdp_turbo.quantization.transform"} <= set(SOURCES)


def test_no_import_cycles():
    assert import_cycles(import_graph(SOURCES)) == []


def test_import_cycles_are_detected():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_plan_command_reaches_no_feature_package():
    reached = _reachable(import_graph(SOURCES), "fsdp_turbo.cli.plan")
    assert "fsdp_turbo.fsdp_turbo" in reached
    assert sorted(m for m in reached if m.startswith(FEATURE_PACKAGES)) == []


def _defined_functions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                found.setdefault(node.name, []).append(module)
    return found


def test_shared_helpers_exist_once_in_core():
    defined = _defined_functions()
    for helper in ("local_tensor", "is_dtensor", "has_router_forward", "fused_experts_form"):
        assert defined[helper] == [MODEL_INSPECT], helper
    assert "_local" not in defined  # the old per-package copies
    for module, path in SOURCES.items():
        if module != MODEL_INSPECT:
            assert "_local_tensor" not in path.read_text(encoding="utf-8"), module


def _calls(module: str, function: str) -> set[str]:
    tree = ast.parse(SOURCES[module].read_text(encoding="utf-8"))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {n.func.id for n in ast.walk(body) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_expert_parallel_and_quantization_recognise_fused_experts_alike():
    assert "fused_experts_form" in _calls("fsdp_turbo.distributed.expert_parallel.experts", "detect")
    assert "fused_experts_form" in _calls("fsdp_turbo.quantization.training.mx_experts", "is_fused_experts")
