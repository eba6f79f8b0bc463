"""Expert forms: how one shape of expert container is recognised, sharded and run.

A form is an :class:`ExpertAdapter` subclass registered with :func:`register_expert_form`.
The planner asks every registered form, newest first, whether it recognises a module that
``ep_plan.apply_modules`` picked (:meth:`ExpertAdapter.detect`); the first that does gives
the adapter the dispatchers use. The built-in forms are registered the same way, so a form
registered later is asked first and may take over a module a built-in one also matches.

The dispatchers only ever see ``(hidden_states [rows, H], top_k_index [rows, k],
top_k_weights [rows, k])`` and return ``[rows, H]``; :meth:`ExpertAdapter.run_forward`
translates the container's own call into that, so no form needs a case in a dispatcher.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fsdp_turbo.core.expert_forms import (
    add_expert_form,
    recognise_experts,
    registered_expert_forms,
    remove_expert_form,
)
from fsdp_turbo.core.model_inspect import EXPERT_FORWARD_ALIASES

Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``dispatch(hidden_states, top_k_index, top_k_weights) -> [rows, H]``: what the unsharded
experts would return for these rows, summed over each row's ``k`` slots with their weights."""


@dataclass(frozen=True)
class ExpertAdapter(abc.ABC):
    """How to shard and run one form of expert container. A value (it holds no module),
    so it can sit in the expert-parallel plan.

    A form implements :meth:`detect`, :meth:`keep_local_experts` and :meth:`eager`; also
    :meth:`grouped` for the ``fused``, ``mc2`` and ``domino`` dispatchers' grouped GEMMs,
    :meth:`run_forward` when its forward is not ``(hidden_states, top_k_index, top_k_weights)``,
    and :meth:`check` when a container of the form may ask for something it cannot do.
    ``form`` describes it in the error for a module no form recognises."""

    num_experts: int
    form: ClassVar[str] = ""

    @classmethod
    @abc.abstractmethod
    def detect(cls, module: nn.Module) -> ExpertAdapter | None:
        """The adapter for ``module`` if it has this form, else ``None``. Reads the module only."""

    @abc.abstractmethod
    def keep_local_experts(self, module: nn.Module, first: int, count: int, ep_mesh) -> None:
        """Keep experts ``[first, first + count)``; parameter names do not change. ``ep_mesh``
        (1-D over the EP group, or ``None``) lets weights become DTensors of global shape."""

    @abc.abstractmethod
    def eager(self, module: nn.Module, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Run each row of ``x`` through local expert ``expert[row]``, one expert at a time."""

    def grouped(self, module: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        """Run expert-major ``x`` (``group_sizes[e]`` rows for local expert ``e``) at once. The
        default is :meth:`eager` on those rows: override it with grouped GEMMs."""
        local = torch.arange(group_sizes.numel(), device=x.device)
        return self.eager(module, x, torch.repeat_interleave(local, group_sizes, output_size=x.shape[0]))

    replicable: ClassVar[bool] = False
    """Whether :meth:`home_weights` can feed replicas (``ep_plan.redundant_experts``)."""

    def home_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's experts as stacked weights ``[local, ...]`` per name, the way the form's
        GEMMs read them, differentiable to the parameters: what a replica copies. A form that
        sets ``replicable`` runs, in a forward that has them (:func:`replicas_in_forward`), the
        replica slots after its own experts: slot ``local + j`` on replica ``j``'s weights.
        Empty: cannot replicate."""
        return {}

    def check(self, name: str, module: nn.Module) -> None:
        """Raise ``ConfigError`` for what this container asks that the form cannot honour under
        expert parallel (called by the planner, before anything is changed or sent). The
        default asks nothing."""
        return None

    def run_forward(self, dispatch: Dispatch, *args, **kwargs) -> torch.Tensor:
        """The container's forward, expert-parallel: turn its arguments into ``dispatch``'s
        and its result into the container's. The default is the router-style forward, its
        keywords under their names or the aliases other models use (gpt-oss:
        ``router_indices``, ``routing_weights``)."""
        return dispatch(*args, **{EXPERT_FORWARD_ALIASES.get(k, k): v for k, v in kwargs.items()})


_REPLICAS = "ep_replica_weights"  # on an expert container during a forward: its replicas' weights


@contextlib.contextmanager
def replica_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """While active, ``module``'s replica slots hold ``weights`` (``[spare, ...]`` per name of
    :meth:`ExpertAdapter.home_weights`; :func:`replicas_in_forward` reads them)."""
    object.__setattr__(module, _REPLICAS, weights)
    try:
        yield
    finally:
        object.__delattr__(module, _REPLICAS)


def replicas_in_forward(module: nn.Module) -> dict[str, torch.Tensor]:
    """The replica slots' weights ``module`` (an expert container) has in this forward, ``[spare, ...]``
    per name; empty outside :func:`replica_weights`."""
    return getattr(module, _REPLICAS, {})


def register_expert_form(cls: type[ExpertAdapter]) -> type[ExpertAdapter]:
    """Add ``cls`` to the forms the model facts and the planner try (newest first); usable
    as a decorator. Registering a class again moves it to the front. The registry itself is
    turbo-core's (``core.expert_forms``), so the model facts recognise experts through it."""
    if not (isinstance(cls, type) and issubclass(cls, ExpertAdapter)):
        raise TypeError(f"an expert form is an ExpertAdapter subclass, not {cls!r}")
    if getattr(cls, "__abstractmethods__", None):
        raise TypeError(f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unimplemented")
    if not cls.form:
        raise TypeError(f"{cls.__name__} needs a `form` description (named in the error for unmatched modules)")
    add_expert_form(cls)
    return cls


def unregister_expert_form(cls: type[ExpertAdapter]) -> None:
    """Forget ``cls`` (a no-op if it is not registered)."""
    remove_expert_form(cls)


def expert_forms() -> Sequence[type[ExpertAdapter]]:
    """The registered forms, in the order they are tried."""
    return registered_expert_forms()


def expert_adapter(module: nn.Module) -> ExpertAdapter | None:
    """The adapter of the first registered form that recognises ``module``, or ``None``."""
    found = recognise_experts(module)
    return None if found is None else found[1]


def keep_expert_rows(module: nn.Module, names: Sequence[str], first: int, count: int, ep_mesh, *,
                     rows_per_expert: int = 1) -> None:
    """For forms whose parameters hold each expert's ``rows_per_expert`` rows together along
    dim 0 (one row: a fused ``[E, ...]`` weight; ``r`` rows: a LoRA ``lora_A [E * r, in]``):
    keep experts ``[first, first + count)`` of each parameter in ``names``. A DTensor sharded
    over EP keeps the global shape, so ``state_dict``, DCP and ``full_tensor()`` see all experts."""
    from torch.distributed.tensor import DTensor, Shard

    for name in names:
        full = getattr(module, name)
        block = full.detach()[first * rows_per_expert : (first + count) * rows_per_expert].clone()
        local = DTensor.from_local(block, ep_mesh, [Shard(0)], run_check=False) if ep_mesh else block
        setattr(module, name, nn.Parameter(local, requires_grad=full.requires_grad))


def loop_over_experts(x: torch.Tensor, expert: torch.Tensor, count: int,
                      run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """An :meth:`ExpertAdapter.eager` body: ``run(e, rows)`` for each of the ``count`` local
    experts on the rows of ``x`` routed to it, put back in row order."""
    # Experts with no rows still run (on zero rows): their weights then get a zero gradient,
    # so every rank of an expert-FSDP group reduces the same set of gradients.
    order = torch.argsort(expert, stable=True)
    groups = order.split(torch.bincount(expert, minlength=count).tolist())
    outputs = [run(index, x[rows]) for index, rows in enumerate(groups)]
    return x.new_zeros(x.shape[0], outputs[0].shape[-1]).index_copy(0, torch.cat(groups), torch.cat(outputs))
