"""The transform plugin interface and its registry.

Every feature is a :class:`Transform` in two steps. ``plan`` resolves the config on the
model into a :class:`FeaturePlan`, an immutable value, and communicates nothing. It reads
what the model is from the :class:`~fsdp_turbo.core.model_facts.ModelFacts` it is given
(resolved once, by the facade), never by inspecting the model for those facts itself.
``apply`` carries that plan out and resolves nothing again. The facade plans every
enabled feature on every rank before any collective, then applies the plans in stage
order; ``fsdp-turbo plan`` prints the same plans. Packages register their transforms
through the entry-point group ``fsdp_turbo.transforms``; the core never imports a
feature package by name.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from fsdp_turbo.core.features import feature_named

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel
    from fsdp_turbo.core.model_facts import ModelFacts
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.core.stage_part import StageRole
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

ENTRY_POINT_GROUP = "fsdp_turbo.transforms"


class Stage:
    """Pipeline positions; lower runs first. Gaps leave room for third-party transforms.

    Which plan each feature receives (``Transform.requires``), and why. Plans are made in
    an order that puts each after the plans it needs; they are applied in stage order.

    ===============  ==============================  ==================================================
    feature          receives the plan of            to
    ===============  ==============================  ==================================================
    quantize         tensor_parallel                 leave Linears whose TP shard holds no whole block
    tensor_parallel  expert_parallel                 leave expert containers to EP; require sequence
                                                     parallel when EP runs beside TP
    swap_activation  recompute                       swap recomputed blocks' checkpoint inputs; skip
                                                     blocks inside a recomputed block
    chunk_batch      recompute                       slice the re-run of recomputed blocks too (memory
                                                     estimate)
    fully_shard      expert_parallel, chunk_loss     shard experts on the expert mesh first; not
                                                     backward-prefetch a chunked-loss head
    ===============  ==============================  ==================================================

    Three features change how the loss is computed, each in its own place: tensor
    parallel's loss parallel wraps ``model.loss_function``; the chunked loss replaces the
    head's forward and then ``model.loss_function`` (so it sees loss parallel's vocab
    shards through the head's DTensor weight); context parallel sums the loss over the CP
    group in a forward hook on the root's output, after both.
    """

    PIPELINE = 50  # splits the model into this rank's stages; every other feature applies to each
    QUANTIZE = 100
    TENSOR_PARALLEL = 200
    EXPERT_PARALLEL = 300
    CONTEXT_PARALLEL = 400
    RECOMPUTE = 500
    CHUNK_BATCH = 520
    CHUNK_LOSS = 550
    SWAP_ACTIVATION = 600
    COMPILE = 650
    FULLY_SHARD = 700
    OPTIMIZER_HOOKS = 800


@dataclass(frozen=True)
class PlanRow:
    """One line of ``fsdp-turbo plan``: a label (a config field) and the module names it resolved to.
    A row about one kind of attention (an ``AttentionKind`` value, or ``"per-head parameters"``)
    names it in ``kind``: the plan prints it in its attention-kinds block, under that kind."""

    label: str
    names: tuple[str, ...]
    kind: str = ""


class FeaturePlan:
    """What one transform resolved, as a value.

    Subclasses are frozen dataclasses of names, numbers, enums and config objects: no
    modules, tensors or process groups. So a plan compares equal across ranks, pickles,
    and is safe to keep after the model has changed.
    """

    def describe(self) -> tuple[PlanRow, ...]:
        """The rows ``fsdp-turbo plan`` prints for this feature."""
        return ()

    def estimate(self, memory: MemoryModel) -> None:
        """Refine the per-rank memory estimate in place, where the feature changes memory."""
        return None


class SplitsParameters(Protocol):
    """A plan that splits parameters across ranks (tensor parallel's). Other features read
    it through this, without importing the package that made it."""

    def local_shape(self, parameter: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """``shape`` of the parameter named ``parameter`` as one rank holds it."""


Plans = Mapping[str, "FeaturePlan | None"]
"""The plans a transform asked for in ``requires``, by feature name; ``None`` where that feature is off."""


class Transform(abc.ABC):
    """One feature applied to the model by the facade.

    ``plan`` must raise ``ConfigError`` for every bad input and must not communicate;
    ``apply`` may. Both see the same parallel state on every rank. ``requires`` names
    the features whose plans ``plan`` receives (see :class:`Stage`); every ``plan`` also
    receives the model facts.
    """

    name: str = ""
    stage: int = 0
    requires: tuple[str, ...] = ()
    # A transform that splits the model (pipeline parallel) is not applied in place: the
    # facade calls ``split`` (this rank's parts), applies every other feature to each part,
    # then ``join`` (what runs them, attached to the first part).
    splits_model: bool = False

    def split(self, model: nn.Module, plan: FeaturePlan, parallel_state: ParallelState) -> list[tuple[Any, nn.Module]]:
        raise NotImplementedError(f"{type(self).__name__} does not split the model")

    def join(self, parts: list[tuple[Any, nn.Module]], plan: FeaturePlan, parallel_state: ParallelState) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not split the model")

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        """Whether the config asks for this feature. The built-in features answer from
        ``core.features.FEATURES`` alone; a third-party transform, which has no row there,
        overrides this."""
        feature = feature_named(self.name)
        if feature is None:
            raise NotImplementedError(f"{type(self).__name__} ({self.name!r}) has no row in "
                                      "fsdp_turbo.core.features.FEATURES; override is_enabled")
        return feature.requested(config, parallel_state)

    def on_stage(self, role: StageRole) -> bool:
        """Whether this feature has work on a pipeline stage of ``role`` (the chunked loss:
        only where the head is). Default: on every stage."""
        return True

    @abc.abstractmethod
    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> FeaturePlan:
        """Resolve the config on ``model``; ``upstream`` holds the plans named in ``requires``,
        ``facts`` what the model is (its blocks, head, attention, inputs, experts, ...)."""

    @abc.abstractmethod
    def apply(self, model: nn.Module, plan: FeaturePlan, parallel_state: ParallelState) -> nn.Module:
        """Carry ``plan`` out on ``model`` (in place) and return it."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, stage={self.stage})"


class TransformRegistry:
    """Transforms by name: those from entry points plus any registered in code."""

    def __init__(self, *, load_entry_points: bool = True) -> None:
        self._manual: dict[str, Transform] = {}
        self._loaded: dict[str, Transform] | None = None if load_entry_points else {}

    def register(self, transform: Transform) -> None:
        if not transform.name:
            raise ValueError(f"{transform!r} has no name")
        self._manual[transform.name] = transform

    def unregister(self, name: str) -> None:
        self._manual.pop(name, None)

    def _from_entry_points(self) -> dict[str, Transform]:
        if self._loaded is None:
            found: dict[str, Transform] = {}
            for point in entry_points(group=ENTRY_POINT_GROUP):
                factory = point.load()
                transform = factory() if isinstance(factory, type) else factory
                if not isinstance(transform, Transform):
                    raise TypeError(f"entry point {point.name!r} gives {transform!r}, not a Transform")
                found[transform.name] = transform
            self._loaded = found
        return self._loaded

    def get(self, name: str) -> Transform | None:
        return self._manual.get(name) or self._from_entry_points().get(name)

    def all(self) -> list[Transform]:
        merged = {**self._from_entry_points(), **self._manual}
        return sorted(merged.values(), key=lambda t: (t.stage, t.name))


def planning_order(transforms: list[Transform]) -> list[Transform]:
    """``transforms`` ordered so that each comes after the enabled ones it ``requires``;
    otherwise in stage order. A cycle is a programming error."""
    by_name = {t.name: t for t in transforms}
    done: dict[str, Transform] = {}
    visiting: set[str] = set()

    def visit(transform: Transform) -> None:
        if transform.name in done:
            return
        if transform.name in visiting:
            raise ValueError(f"transforms require each other in a cycle through {transform.name!r}")
        visiting.add(transform.name)
        for needed in transform.requires:
            if needed in by_name:
                visit(by_name[needed])
        visiting.discard(transform.name)
        done[transform.name] = transform

    for transform in transforms:
        visit(transform)
    return list(done.values())


registry = TransformRegistry()
