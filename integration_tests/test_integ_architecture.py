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


# ----- one place for what the model is ---------------------------------------------------
# How a model describes itself; only core.model_facts reads these, once per FSDPTurbo call.
SELF_DESCRIPTION = {"get_output_embeddings", "get_input_embeddings", "_no_split_modules", "model_config_value"}
# The feature packages' plain APIs, usable without the facade, resolve the facts themselves.
PLAIN_APIS = {("fsdp_turbo.memory.chunk_loss.hf_head", "install_chunked_loss"),
              ("fsdp_turbo.quantization.converter.plan", "convert_model"),
              ("fsdp_turbo.distributed.expert_parallel.transform", "apply_expert_parallel"),
              ("fsdp_turbo.distributed.context_parallel.transform", "apply_context_parallel")}


def _feature_modules():
    return {m: p for m, p in SOURCES.items() if m.startswith(FEATURE_PACKAGES)}


def _names_used(tree: ast.AST) -> set[str]:
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return names | {alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names}


def test_no_feature_package_inspects_the_model_for_its_facts():
    for module, path in _feature_modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not _names_used(tree) & SELF_DESCRIPTION, module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "fsdp_turbo.core.model_facts":
                assert not [a.name for a in node.names if a.name.startswith("_")], module


def test_only_the_plain_apis_resolve_facts_themselves():
    callers = set()
    for module, path in _feature_modules().items():
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            called = {n.func.id for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            # plain_api_facts: the families' member patches, then resolve_model_facts
            if isinstance(function, ast.FunctionDef) and called & {"resolve_model_facts", "plain_api_facts"}:
                callers.add((module, function.name))
    assert callers == PLAIN_APIS


def test_every_plan_receives_the_facts():
    from inspect import signature

    from fsdp_turbo.core.plugin import registry

    transforms = registry.all()
    assert len(transforms) >= 10
    for transform in transforms:
        assert "facts" in signature(transform.plan).parameters, transform


def test_no_plan_config_holds_a_model_fact():
    import dataclasses

    from fsdp_turbo.core.model_facts import ModelFactsConfig
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    facts = {f.name for f in dataclasses.fields(ModelFactsConfig)}
    assert {"head_module", "attention_function", "token_input", "ignore_index"} <= facts
    for name, section in FSDPTurboConfig._nested.items():
        if section is not ModelFactsConfig:
            assert not {f.name for f in dataclasses.fields(section)} & facts, name
    assert not {f.name for f in dataclasses.fields(FSDPTurboConfig)} & facts


# ----- the command: short named steps ----------------------------------------------------
CLI_LIMIT = 60  # lines, from the def line to the body's last line


def test_no_function_in_the_command_exceeds_sixty_lines():
    long = []
    for module, path in SOURCES.items():
        if module.startswith("fsdp_turbo.cli"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > CLI_LIMIT:
                        long.append(f"{module}.{node.name}: {length} lines")
    assert long == []


def test_the_config_reference_is_complete_and_fresh():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    for field in ("model_facts", "head_module", "num_chunks", "emax_elem", "cast_forward_inputs", "output_dtype",
                  "compile_backend", "z_loss_weight", "logit_softcap", "swap_force"):
        assert f"| `{field}` |" in text, field


def test_a_field_without_a_docstring_is_caught():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    generator = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = generator  # its dataclasses look their module up
    spec.loader.exec_module(generator)
    source = ('class S(ConfigSection):\n    _prefix: ClassVar[str] = "s"\n\n    size: int = 1\n'
              '    """Documented."""\n\n    bare: bool = False\n')
    section = generator._section(source, ast.parse(source).body[0])
    assert generator.undocumented({"library": [section]}) == ["S.bare"]
