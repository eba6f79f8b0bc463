"""What the model is, resolved once per ``FSDPTurbo`` call: :class:`ModelFacts`.

Every feature needs the same few facts about the model: its repeated blocks (FSDP units,
recompute, swap and compile wrap them), its output head (tensor parallel gathers before
it, the chunked loss replaces it, quantization leaves it in high precision), its core
attention and input names (context parallel), its expert containers, the label value no
loss counts, and its head counts. They are answered here, once, and every planner receives
the answers beside its upstream plans. No feature package inspects the model for them.

Each fact comes from one of two places, and ``fsdp-turbo plan`` prints which:

* **detected**: Hugging Face models describe themselves (``_no_split_modules``,
  ``get_output_embeddings()``, ``get_input_embeddings()``, ``config._attn_implementation``,
  ``config.num_attention_heads``); other models fall back to structure (the largest list of
  same-class blocks; the registered expert forms);
* **configured**: the config's ``model_facts`` section (:class:`ModelFactsConfig`), for a
  model that does not describe itself, such as torchtitan's. A configured fact wins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.expert_forms import recognise_experts
from fsdp_turbo.core.families import family_for
from fsdp_turbo.core.families.resolve import (
    AttentionLayer,
    HeadParameterFact,
    HeadsNormFact,
    LatentFact,
    ModelSizes,
    attention_layers,
    head_counts,
    head_parameters,
    heads_norms,
    latent_modules,
    model_sizes,
    of_classes,
    routers,
)
from fsdp_turbo.core.forms import class_names
from fsdp_turbo.core.patterns import match_modules, matches_any
from fsdp_turbo.core.validation import ConfigSection, check_int, check_optional_patterns

IGNORE_INDEX = -100
"""The label value no loss counts, unless ``model_facts.ignore_index`` says otherwise:
PyTorch's ``cross_entropy`` default and Hugging Face's. The one default every loss, the
data pipeline and context parallel's padding read."""

DEFAULT_TOKEN_INPUT = "input_ids"  # Hugging Face's forward argument names
DEFAULT_POSITION_INPUT = "position_ids"


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _check_module_name(value: Any, field: str, example: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(field, value, f"name the module by its qualified name, e.g. {example!r}")


def _check_argument_name(value: Any, field: str, example: str) -> None:
    if value is not None and (not isinstance(value, str) or not value.isidentifier()):
        raise ConfigError(field, value, f"name an argument of the model's forward, e.g. {example!r}")


@dataclass(frozen=True)
class ModelFactsConfig(ConfigSection):
    """What the model is, for models that do not say it themselves. Every field left unset
    is detected (Hugging Face models need none of them); a field that is set wins over
    detection. Every feature reads these facts from here, and from nowhere else."""

    _prefix: ClassVar[str] = "model_facts"

    blocks: tuple[str, ...] | None = None
    """Patterns of the model's repeated blocks, e.g. ``["layers.*"]`` (outermost matches). They are
    the default FSDP units and the default blocks of recompute, activation swap and compile.
    Unset: the classes in Hugging Face's ``_no_split_modules``, else the children of the
    model's largest list of same-class modules."""

    head_module: str | None = None
    """The output head's qualified name, e.g. ``"output"``. Tensor parallel gathers before it and
    shards it for loss parallel, the chunked loss replaces it, quantization leaves it in high
    precision. Unset: Hugging Face's ``get_output_embeddings()``."""

    embedding_module: str | None = None
    """The token embedding's qualified name, e.g. ``"tok_embeddings"``. Unset: Hugging Face's
    ``get_input_embeddings()``."""

    attention_function: str | None = None
    """A dotted path to the core attention function the model calls, ``(q, k, v, **kwargs) ->
    out`` on ``[batch, heads, seq, head_dim]`` like ``F.scaled_dot_product_attention``, e.g.
    ``"my_model.attention.core_attention"``. Context parallel runs it on the whole sequence
    (Ulysses) or replaces it (ring). Give this or ``attention_modules``, not both. Unset: the
    Hugging Face attention interface named by ``config._attn_implementation``."""

    attention_modules: tuple[str, ...] | None = None
    """Patterns of the modules whose forward is the core attention (as ``attention_function``),
    e.g. torchtitan's ``["layers.*.attention.inner_attention"]``. Give this or
    ``attention_function``, not both."""

    token_input: str | None = None
    """The forward argument that holds the ``[batch, seq]`` tokens (or embeddings) context
    parallel splits on the sequence, e.g. torchtitan's ``"tokens"``. Unset: ``"input_ids"``."""

    position_input: str | None = None
    """The forward argument that receives each rank's absolute positions ``[batch, seq/cp]``
    under context parallel, e.g. ``"positions"``. Unset: ``"position_ids"``."""

    expert_modules: tuple[str, ...] | None = None
    """Patterns of the MoE expert containers, e.g. ``["layers.*.moe.experts"]`` (outermost
    matches). Unset: every module a registered expert form recognises (expert parallel
    registers the fused, module-list and counted forms)."""

    ignore_index: int = IGNORE_INDEX
    """The label value that no loss counts (padding, prompts, document starts). The one value
    for the model's loss, ``lm_loss``, the chunked loss, loss parallel, context parallel's
    padding and the ``fsdp-turbo`` data pipeline."""

    num_attention_heads: int | None = None
    """The model's query heads, for the tensor- and context-parallel head splits. Unset:
    ``config.num_attention_heads`` (or ``n_head`` / ``num_heads``) where the model declares it."""

    num_key_value_heads: int | None = None
    """The model's key/value heads (grouped-query attention). Unset: ``config.num_key_value_heads``
    (or ``n_kv_heads``), else the query heads."""

    head_parameters: tuple[str, ...] | None = None
    """Patterns of parameters an attention holds itself, one entry per query head along dim 0,
    written ``module.parameter``, e.g. ``["layers.*.attention.sinks"]``: tensor parallel splits
    them with the heads, Ulysses cuts them to each rank's heads. Added to the registered
    families' (gpt-oss's sinks)."""

    latent_modules: tuple[str, ...] | None = None
    """Patterns of modules inside an attention whose output every head reads, e.g. a low-rank
    key/value projection ``["layers.*.attention.kv_latent"]``: tensor parallel keeps them whole
    beside the head-split projections and sums their gradient. Added to the registered
    families' (DeepSeek's MLA). A latent whose last outputs every head reads directly (MLA's
    rotary key) is declared with ``fsdp_turbo.core.families.register_family``."""

    router_modules: tuple[str, ...] | None = None
    """Patterns of the MoE routers, e.g. ``["layers.*.moe.router"]``: quantization leaves them
    in high precision. Unset: the registered families' router classes and Hugging Face's
    convention (a ``gate`` or ``router`` beside the expert container)."""

    def __post_init__(self) -> None:
        p = self._prefix
        _set(self, "blocks", check_optional_patterns(self.blocks, f"{p}.blocks"))
        _check_module_name(self.head_module, f"{p}.head_module", "output")
        _check_module_name(self.embedding_module, f"{p}.embedding_module", "tok_embeddings")
        fn = self.attention_function
        if fn is not None and (not isinstance(fn, str) or "." not in fn):
            raise ConfigError(f"{p}.attention_function", fn, "use a dotted path such as 'my_pkg.attn.core_attention'")
        _set(self, "attention_modules", check_optional_patterns(self.attention_modules, f"{p}.attention_modules"))
        if fn is not None and self.attention_modules is not None:
            raise ConfigError(f"{p}.attention_modules", list(self.attention_modules),
                              "give attention_function or attention_modules, not both",
                              reason=f"attention_function is {fn!r}")
        _check_argument_name(self.token_input, f"{p}.token_input", "tokens")
        _check_argument_name(self.position_input, f"{p}.position_input", "positions")
        _set(self, "expert_modules", check_optional_patterns(self.expert_modules, f"{p}.expert_modules"))
        check_int(self.ignore_index, f"{p}.ignore_index")
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), f"{p}.{name}", minimum=1)
        for name in ("head_parameters", "latent_modules", "router_modules"):
            _set(self, name, check_optional_patterns(getattr(self, name), f"{p}.{name}"))


# ----- the facts ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Attention:
    """The model's core attention: one of an HF attention implementation, a function by its
    dotted path, or the modules whose forward it is; ``kind`` is ``""`` when none is known."""

    kind: str = ""  # "hf", "function", "modules" or ""
    hf_implementation: str | None = None
    function_path: str | None = None
    module_names: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "modules":
            more = len(self.module_names) - 1
            return self.module_names[0] + (f" (and {more} more)" if more else "")
        if self.kind == "function":
            return str(self.function_path)
        if self.kind == "hf":
            return f"HF attention '{self.hf_implementation}'"
        return "none found"


@dataclass(frozen=True)
class ExpertContainer:
    name: str
    form: str | None  # the registered form that recognises it (None: no form does)


@dataclass(frozen=True)
class FactRow:
    """One line of the facts as ``fsdp-turbo plan`` prints them."""

    label: str
    value: str
    source: str


@dataclass(frozen=True)
class ModelFacts:
    """What the model is. A value: names, numbers and strings, so it compares equal across
    ranks and pickles, like the plans made from it."""

    blocks: tuple[str, ...]  # the repeated blocks, in model order
    head: str | None  # the output head
    embedding: str | None  # the token embedding
    attention: Attention
    token_input: str  # forward argument with the tokens context parallel splits
    position_input: str  # forward argument that receives the positions
    experts: tuple[ExpertContainer, ...]
    ignore_index: int
    num_attention_heads: int | None
    num_key_value_heads: int | None
    sources: tuple[tuple[str, str], ...] = ()  # fact -> "detected: ..." or "configured: model_facts.X"
    # the family facts (core.families), resolved to module names
    family: str = ""  # the family whose model facts apply ("" : Hugging Face's conventions)
    attention_layers: tuple[AttentionLayer, ...] = ()  # every token mixer, with its kind
    head_parameters: tuple[HeadParameterFact, ...] = ()  # per-head parameters attentions hold
    latent_modules: tuple[LatentFact, ...] = ()  # modules whose output every head reads
    heads_norms: tuple[HeadsNormFact, ...] = ()  # norms over every head's channels at once
    routers: tuple[str, ...] = ()
    indexers: tuple[str, ...] = ()  # modules picking a sparse attention's keys
    compressors: tuple[str, ...] = ()  # modules compressing the whole sequence into extra key/value entries
    sizes: ModelSizes = field(default_factory=ModelSizes)
    block_token_inputs: tuple[str, ...] = ()  # block arguments holding a value per token beside the hidden states
    before_blocks: tuple[str, ...] = ()  # modules outside the blocks that run before them (on the whole sequence)
    after_blocks: tuple[str, ...] = ()  # modules outside the blocks, beside the final norm, that run after them

    def source(self, fact: str) -> str:
        return dict(self.sources).get(fact, "")

    def block_modules(self, model: nn.Module, patterns: Sequence[str] | None, *, field: str) -> dict[str, nn.Module]:
        """A per-block feature's modules: the outermost matches of its ``patterns`` (its own
        plan), else the repeated blocks. Raises ``ConfigError`` on ``field``."""
        if patterns is not None:
            return match_modules(model, patterns, field=field, outermost=True)
        if not self.blocks:
            raise ConfigError(field, None, f"give {field}=['model.layers.*'], or name the blocks once in "
                              "model_facts.blocks", reason="the model has no recognisable repeated blocks")
        return {name: model.get_submodule(name) for name in self.blocks}

    def layers_of(self, kind: str) -> tuple[AttentionLayer, ...]:
        """The token mixers of one kind (an ``AttentionKind`` value)."""
        return tuple(layer for layer in self.attention_layers if layer.kind == kind)

    def head_parameters_of(self, module: str) -> tuple[HeadParameterFact, ...]:
        return tuple(p for p in self.head_parameters if p.module == module)

    def latent(self, module: str) -> LatentFact | None:
        return next((latent for latent in self.latent_modules if latent.module == module), None)

    def rows(self) -> tuple[FactRow, ...]:
        def row(label: str, fact: str, value: str) -> FactRow:
            return FactRow(label, value, self.source(fact))

        heads = "not declared" if self.num_attention_heads is None else (
            f"{self.num_attention_heads} query, {self.num_key_value_heads} key/value")
        per_head = tuple(f"{p.module}.{p.parameter}" for p in self.head_parameters)
        return (row("repeated blocks", "blocks", _names(self.blocks)),
                row("output head", "head", self.head or "none found"),
                row("embedding", "embedding", self.embedding or "none found"),
                row("core attention", "attention", self.attention.describe()),
                row("inputs", "inputs", f"tokens '{self.token_input}', positions '{self.position_input}'"),
                row("expert containers", "experts", _names(tuple(e.name for e in self.experts))),
                row("ignore_index", "ignore_index", str(self.ignore_index)),
                row("attention heads", "heads", heads),
                row("family", "family", self.family or "Hugging Face's conventions"),
                row("per-head parameters", "head_parameters", _names(per_head)),
                row("latents every head reads", "latent_modules", _names(tuple(m.module for m in self.latent_modules))),
                row("routers", "routers", _names(self.routers)))


def _names(names: tuple[str, ...]) -> str:
    if not names:
        return "none found"
    return names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]} ({len(names)})"


# ----- detection ---------------------------------------------------------------------------
def _outermost(named: dict[str, nn.Module]) -> dict[str, nn.Module]:
    return {n: m for n, m in named.items() if not any(n.startswith(p + ".") for p in named if p != n)}


def _detect_blocks(model: nn.Module) -> tuple[tuple[str, ...], str]:
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    if block_classes:
        named = _outermost({n: m for n, m in model.named_modules() if n and class_names(m) & block_classes})
        if named:
            return tuple(named), "detected: Hugging Face _no_split_modules"
    best: tuple[int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.ModuleDict) and len(module) and len(
                {type(m) for m in module.children()}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    if best is None:
        return (), "detected: none"
    _, prefix, blocks = best
    names = tuple(f"{prefix}.{key}" if prefix else key for key, _ in blocks.named_children())
    return names, "detected: the largest list of same-class modules"


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module and n), None)


def _hf_module(model: nn.Module, getter: str) -> nn.Module | None:
    method = getattr(model, getter, None)
    if not callable(method):
        return None
    try:
        return method()
    except NotImplementedError:  # transformers' base class, for a model without that module
        return None


def _named_module(model: nn.Module, name: str | None, field: str, getter: str) -> tuple[str | None, str]:
    if name is not None:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ConfigError(field, name, "name a module of the model by its qualified name",
                              reason="no such module") from None
        return name, f"configured: {field}"
    found = _name_of(model, _hf_module(model, getter))
    return found, f"detected: {getter}()" if found else "detected: none"


def import_attention_function(path: str, field: str = "model_facts.attention_function") -> Callable[..., Any]:
    """The function ``path`` names. Raises ``ConfigError`` on ``field``."""
    module_name, _, attr = path.rpartition(".")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(field, path, "give an importable 'package.module.function'",
                          reason=f"it does not import ({err})") from err
    if not callable(function):
        raise ConfigError(field, path, "point it at a function", reason="not callable")
    return function


def _attention(model: nn.Module, config: ModelFactsConfig) -> tuple[Attention, str]:
    if config.attention_modules is not None:
        found = match_modules(model, config.attention_modules, field="model_facts.attention_modules")
        return Attention("modules", module_names=tuple(found)), "configured: model_facts.attention_modules"
    if config.attention_function is not None:
        import_attention_function(config.attention_function)
        return (Attention("function", function_path=config.attention_function),
                "configured: model_facts.attention_function")
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation is None:
        return Attention(), "detected: none"
    return Attention("hf", hf_implementation=implementation), "detected: config._attn_implementation"


def _experts(model: nn.Module, config: ModelFactsConfig) -> tuple[tuple[ExpertContainer, ...], str]:
    def form(module: nn.Module) -> str | None:
        found = recognise_experts(module)
        return None if found is None else found[0].__name__

    if config.expert_modules is not None:
        found = match_modules(model, config.expert_modules, field="model_facts.expert_modules", outermost=True)
        return (tuple(ExpertContainer(n, form(m)) for n, m in found.items()),
                "configured: model_facts.expert_modules")
    recognised = _outermost({n: m for n, m in model.named_modules() if n and form(m) is not None})
    return tuple(ExpertContainer(n, form(m)) for n, m in recognised.items()), "detected: registered expert forms"


def resolve_model_facts(model: nn.Module, config: ModelFactsConfig | None = None) -> ModelFacts:
    """The facts of ``model``, each from ``config`` where it is set, else detected. Raises
    ``ConfigError`` (the same on every rank); reads the model only, never communicates."""
    config = config or ModelFactsConfig()
    if config.blocks is not None:
        blocks = tuple(match_modules(model, config.blocks, field="model_facts.blocks", outermost=True))
        blocks_source = "configured: model_facts.blocks"
    else:
        blocks, blocks_source = _detect_blocks(model)
    head, head_source = _named_module(model, config.head_module, "model_facts.head_module", "get_output_embeddings")
    embedding, embedding_source = _named_module(model, config.embedding_module, "model_facts.embedding_module",
                                                "get_input_embeddings")
    attention, attention_source = _attention(model, config)
    experts, experts_source = _experts(model, config)
    heads, kv_heads, heads_source = head_counts(model, config.num_attention_heads, config.num_key_value_heads)
    configured_inputs = config.token_input is not None or config.position_input is not None
    family = family_for(getattr(model, "config", None))
    return ModelFacts(
        blocks=blocks, head=head, embedding=embedding, attention=attention,
        token_input=config.token_input or DEFAULT_TOKEN_INPUT,
        position_input=config.position_input or DEFAULT_POSITION_INPUT,
        experts=experts, ignore_index=config.ignore_index,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        sources=(("blocks", blocks_source), ("head", head_source), ("embedding", embedding_source),
                 ("attention", attention_source),
                 ("inputs", "configured: model_facts" if configured_inputs else "default: Hugging Face's names"),
                 ("experts", experts_source),
                 ("ignore_index", "configured: model_facts.ignore_index" if config.ignore_index != IGNORE_INDEX
                  else "default"),
                 ("heads", heads_source),
                 ("family", "detected: config.model_type" if family else "default"),
                 ("head_parameters", _family_source(config.head_parameters, "head_parameters")),
                 ("latent_modules", _family_source(config.latent_modules, "latent_modules")),
                 ("routers", "configured: model_facts.router_modules" if config.router_modules
                  else "detected: families and HF's convention")),
        family=family.name if family else "",
        attention_layers=attention_layers(model, blocks),
        head_parameters=head_parameters(model, config.head_parameters),
        latent_modules=latent_modules(model, config.latent_modules),
        heads_norms=heads_norms(model),
        routers=routers(model, config.router_modules),
        indexers=of_classes(model, "indexers"),
        compressors=of_classes(model, "compressors"),
        sizes=model_sizes(model, len(blocks), heads, kv_heads),
        block_token_inputs=family.block_token_inputs if family else (),
        before_blocks=_outside_blocks(model, family.before_blocks if family else ()),
        after_blocks=_outside_blocks(model, family.after_blocks if family else ()))


def _outside_blocks(model: nn.Module, patterns: tuple[str, ...]) -> tuple[str, ...]:
    # A family's patterns name modules some of its models have (Gemma 4 without per-layer inputs has none)
    return tuple(name for name, _ in model.named_modules() if name and matches_any(name, patterns))


def plain_api_facts(model: nn.Module, config: ModelFactsConfig | None = None) -> ModelFacts:
    """The facts a plain API (used without the facade: ``convert_model``, ``apply_expert_parallel``,
    ``apply_context_parallel``, ``install_chunked_loss``) works from: the families' member patches
    applied first, as the facade applies them (Llama 4's experts are only recognised with them),
    then :func:`resolve_model_facts`."""
    from fsdp_turbo.core.module_patches import apply_module_patches

    apply_module_patches(model, ())
    return resolve_model_facts(model, config)


def _family_source(configured: tuple[str, ...] | None, name: str) -> str:
    return f"families and configured: model_facts.{name}" if configured else "detected: families"
