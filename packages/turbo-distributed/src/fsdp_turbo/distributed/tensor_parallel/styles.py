"""Parallel styles that torch does not ship, built on DTensor like torch's own.

* :class:`ReplicateParallel`: a module left out of the TP plan keeps replicated
  DTensor parameters, so every parameter lives on the TP mesh (one layout for the
  optimizer, ``clip_grad_norm_`` and checkpoints), while it computes on local
  tensors. ``gather_sequence=True`` serves an unsharded output head after sequence
  parallel; ``sum_grads=True`` serves a module inside the sequence-parallel region
  (an MoE router or experts), whose ranks see different tokens; ``local_input=True``
  serves a module fed a prepared (replicated DTensor) input: a colwise LoRA's ``lora_A``, or
  MLA's latent projections (``shared_tail``: the rotary key's gradient summed over TP).
* :class:`FrozenKeepingSequenceParallel`: torch's ``SequenceParallel`` for the norms,
  keeping each parameter's ``requires_grad`` (a PEFT model's frozen norms stay frozen).
* :class:`HeadLocalParallel`: a module that acts per attention head on the
  head-sharded activations (Qwen3's ``q_norm``/``k_norm``); its replicated weight
  gets the sum of every rank's gradient.
* :class:`HeadsNormParallel`: an RMS norm over every head's channels of a split projection's
  output (MiniMax-M2's ``q_norm`` over ``[heads * head_dim]``): its weight split with the heads,
  its mean square summed over the TP ranks.
* :class:`PrepareHiddenStates`: converts a block's ``hidden_states`` input (the first
  positional tensor or the ``hidden_states`` keyword) once to a replicated DTensor,
  so the colwise projections that share it cost one collective, not one each. With
  ``head_parameters`` it also splits the parameters the module holds itself per head
  (gpt-oss's attention ``sinks``) with the heads: see :func:`shard_head_parameters`.
* :class:`WholeModuleParallel`: a module TP leaves whole that holds parameters beside
  sub-modules (Qwen3-Next's Gated DeltaNet): its whole subtree replicated; inside the
  sequence-parallel region it runs on the gathered sequence and hands back this rank's slice.
* :class:`ScatterSequence`: the entry into the sequence-parallel region: the full
  hidden states are cut to this rank's sequence slice (no communication forward).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_map

SEQUENCE_DIM = 1

# (module, parameter name): where a parameter is registered
Slot = tuple[nn.Module, str]


def _own_slots(module: nn.Module) -> list[Slot]:
    return [(module, name) for name, _ in module.named_parameters(recurse=False)]


def _distribute_parameters(slots: list[Slot], mesh: DeviceMesh, placement: Placement) -> None:
    """Each parameter becomes a DTensor of ``placement`` on the TP mesh, keeping ``requires_grad``."""
    for owner, name in slots:
        param = owner._parameters[name]
        distributed = distribute_tensor(param.detach(), mesh, [placement])
        owner.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))


class _LocalDuringForward:
    """During a module's forward, each DTensor parameter in ``slots`` is ``local(param)`` (its
    local tensor), so the module's own code runs on plain tensors; each gradient returns to the
    DTensor through ``to_local``. Whatever is registered when the forward starts (possibly
    FSDP's unsharded parameter) is put back after it."""

    def __init__(self, slots: list[Slot], local=DTensor.to_local) -> None:
        self.slots, self.local = slots, local
        self._saved: list[list[tuple[nn.Module, str, nn.Parameter]]] = []

    def swap_in(self) -> None:
        current = [(owner, name, owner._parameters[name]) for owner, name in self.slots
                   if isinstance(owner._parameters[name], DTensor)]
        self._saved.append(current)
        for owner, name, param in current:
            owner._parameters[name] = self.local(param)

    def restore(self) -> None:
        for owner, name, param in self._saved.pop():
            owner._parameters[name] = param


def _gather_sequence(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The whole sequence from every TP rank's slice (backward: this rank's slice of the gradient)."""
    sharded = DTensor.from_local(local, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
    return sharded.redistribute(mesh, [Replicate()]).to_local()


def _cut_sequence(whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence slice of a tensor every TP rank holds alike (backward: the slices'
    gradients gathered)."""
    replicated = DTensor.from_local(whole, mesh, [Replicate()], run_check=False)
    return replicated.redistribute(mesh, [Shard(SEQUENCE_DIM)]).to_local()


def _replicate_own_parameters(target: nn.Module):
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if module is target:
            _distribute_parameters(_own_slots(module), mesh, Replicate())

    return partition


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank saw other tokens).

    Not ``to_local(grad_placements=[Partial()])``: that leaves a ``Partial`` gradient on a
    ``Replicate`` parameter, and FSDP2 reduce-scatters its local tensor as if it were whole."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumTailGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the last ``tail`` features of the gradient over the
    group (each rank's share: those outputs feed every head, and each rank holds some heads)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, tail: int) -> torch.Tensor:
        ctx.group, ctx.tail = group, tail
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        shares = grad[..., -ctx.tail:].contiguous()
        torch.distributed.all_reduce(shares, group=ctx.group)
        grad[..., -ctx.tail:] = shares
        return grad, None, None


def _to_local(outputs: Any) -> Any:
    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, outputs)


class ReplicateParallel(ParallelStyle):
    """Parameters become replicated DTensors on the TP mesh; the module itself computes
    on their local tensors, so any forward (routers, fused experts, norms) runs as is.

    The local views come from ``to_local()``, so each gradient lands on the DTensor
    parameter as ``Replicate``: correct where every TP rank sees the same inputs. Inside
    the sequence-parallel region the ranks see different tokens, so with ``sum_grads``
    each local view's gradient is summed over the TP group first. With
    ``gather_sequence`` the first floating input is all-gathered from sequence shards
    first (an output head after sequence parallel). With ``local_input`` its DTensor
    inputs (replicated: the input a parent prepared for its colwise siblings) become
    local tensors; their gradients return as replicated ones. With ``shared_tail`` the
    gradient of the output's last ``shared_tail`` features is summed over the TP group (MLA's
    rotary key, read by every head: each rank's heads give their share).
    """

    def __init__(self, *, gather_sequence: bool = False, sum_grads: bool = False, local_input: bool = False,
                 shared_tail: int = 0) -> None:
        self.gather_sequence = gather_sequence
        self.sum_grads = sum_grads
        self.local_input = local_input
        self.shared_tail = shared_tail

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        slots = _own_slots(module)
        _distribute_parameters(slots, device_mesh, Replicate())

        def local(param: DTensor) -> torch.Tensor:
            tensor = param.to_local()
            if self.sum_grads and tensor.requires_grad:
                tensor = _SumGradOverGroup.apply(tensor, device_mesh.get_group())
            return tensor

        params = _LocalDuringForward(slots, local)

        def swap_in(mod: nn.Module, args: tuple):
            params.swap_in()
            if self.gather_sequence:
                return _gather_first_float(args, device_mesh)
            if self.local_input:
                return _replicated_locals(args, device_mesh)
            return None

        def swap_out(mod: nn.Module, args: tuple, output: Any):
            params.restore()
            if self.shared_tail:
                return _SumTailGradOverGroup.apply(output, device_mesh.get_group(), self.shared_tail)
            return None

        module.register_forward_pre_hook(swap_in)
        module.register_forward_hook(swap_out)
        return module


def _replicated_locals(args: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(value.redistribute(mesh, [Replicate()]).to_local() if isinstance(value, DTensor) else value
                 for value in args)


def _gather_first_float(args: tuple, mesh: DeviceMesh) -> tuple:
    out, done = [], False
    for value in args:
        if not done and isinstance(value, torch.Tensor) and value.is_floating_point():
            value, done = _gather_sequence(value, mesh), True
        out.append(value)
    return tuple(out)


class FrozenKeepingSequenceParallel(SequenceParallel):
    """``SequenceParallel`` that keeps a frozen parameter frozen: torch's re-registers each
    parameter as a new ``nn.Parameter``, trainable whatever the old one was."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
        module = super()._apply(module, device_mesh)
        for name, param in module.named_parameters():
            if name in frozen:
                param.requires_grad_(False)
        return module


class HeadLocalParallel(ParallelStyle):
    """A module acting per head on ``[..., heads, head_dim]`` inputs whose heads are sharded
    over the TP mesh. It computes on DTensors, so its replicated weight's gradient is the
    sum over every rank's heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def annotate(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(v, mesh, [Shard(v.dim() - 2)], run_check=False)
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v
                for v in inputs
            )

        return distribute_module(module, device_mesh, partition_fn=_replicate_own_parameters(module),
                                 input_fn=annotate, output_fn=lambda mod, outputs, mesh: _to_local(outputs))


class HeadsNormParallel(ParallelStyle):
    """An RMS norm over the last dim of a colwise projection's output, which each TP rank holds a
    slice of (its heads' channels). The weight is split the same way (``Shard(0)``). The module
    runs as written on the slice, with its slice's mean square; its output is then rescaled by
    ``rsqrt(mean_global + eps) / rsqrt(mean_local + eps)``, the global mean square summed over the
    TP ranks with an all-reduce whose backward sums too: the output, and the gradient of the input
    and of each rank's weight slice, are the whole norm's. ``eps`` is the module's own
    (``variance_epsilon`` or ``eps``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(eps, float):
            raise ValueError(f"{type(module).__name__} has no float variance_epsilon or eps to rescale its norm by")
        slots = _own_slots(module)
        _distribute_parameters(slots, device_mesh, Shard(0))
        params = _LocalDuringForward(slots)
        group, ways = device_mesh.get_group(), device_mesh.size()

        def rescale(mod: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            params.restore()
            x = args[0].float()
            local = x.square().sum(-1, keepdim=True)
            total = differentiable_all_reduce(local, group=group)  # its backward sums the gradients too
            channels = x.shape[-1]
            factor = torch.rsqrt(total / (channels * ways) + eps) / torch.rsqrt(local / channels + eps)
            return output * factor.to(output.dtype)

        module.register_forward_pre_hook(lambda mod, args: params.swap_in())
        module.register_forward_hook(rescale)
        return module


def _hidden_states_slot(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    if "hidden_states" in kwargs:
        return "hidden_states", kwargs["hidden_states"]
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            return str(index), value
    return None


def _replace(args: tuple, kwargs: dict, slot: str, value: Any) -> tuple[tuple, dict]:
    if slot == "hidden_states":
        return args, {**kwargs, "hidden_states": value}
    index = int(slot)
    return (*args[:index], value, *args[index + 1 :]), kwargs


class _HiddenStatesHook(ParallelStyle):
    def _convert(self, hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple, kwargs: dict):
            slot = _hidden_states_slot(args, kwargs)
            if slot is None:
                raise ValueError(f"{type(mod).__name__} got no hidden_states tensor to prepare for tensor parallel")
            return _replace(args, kwargs, slot[0], self._convert(slot[1], device_mesh))

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def shard_head_parameters(module: nn.Module, mesh: DeviceMesh, dims: tuple[tuple[str, int], ...]) -> None:
    """Each named parameter of ``module`` (one entry per head along its dim) becomes a DTensor
    sharded on that dim over the TP mesh, as the head-sharded projections beside it are. The
    module's forward reads the attribute whole (``self.sinks``), so during the forward the
    attribute is this rank's local shard: its heads' entries; their gradient returns as the
    same ``Shard`` (every rank sees all tokens of its own heads, so nothing is summed)."""
    for name, dim in dims:
        _distribute_parameters([(module, name)], mesh, Shard(dim))
    params = _LocalDuringForward([(module, name) for name, _ in dims])
    module.register_forward_pre_hook(lambda mod, args: params.swap_in())
    module.register_forward_hook(lambda mod, args, output: params.restore())


class PrepareHiddenStates(_HiddenStatesHook):
    """Local hidden states (sequence-sharded when ``sequence_parallel``) -> replicated DTensor.

    Backward is then one reduce-scatter (SP) or one all-reduce for all the block's
    colwise projections together. ``head_parameters`` (name, head dim) are the module's own
    per-head parameters, split with the heads (:func:`shard_head_parameters`).
    """

    def __init__(self, *, sequence_parallel: bool, head_parameters: tuple[tuple[str, int], ...] = ()) -> None:
        self.layout: Placement = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()
        self.head_parameters = head_parameters

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.head_parameters:
            shard_head_parameters(module, device_mesh, self.head_parameters)
        return super()._apply(module, device_mesh)

    def _convert(self, hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if isinstance(hidden, DTensor):
            return hidden.redistribute(mesh, [Replicate()])
        return DTensor.from_local(hidden, mesh, [self.layout], run_check=False).redistribute(mesh, [Replicate()])


class _SequenceCutter:
    """Cuts whole-sequence tensors to this rank's slice, once: activation recompute re-runs a
    block with the inputs it saved, which are already cut and must not be cut again."""

    def __init__(self) -> None:
        # id -> weak reference; tensors compare by value, so no WeakSet.
        self._produced: dict[int, weakref.ref] = {}

    def cut(self, whole: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        seen = self._produced.get(id(whole))
        if seen is not None and seen() is whole:
            return whole
        length, ways = whole.shape[SEQUENCE_DIM], mesh.size()
        if length % ways:
            raise ValueError(f"sequence parallel needs the sequence length ({length}) to be a multiple of the "
                             f"tensor-parallel size ({ways}); pad the batch")
        local = _cut_sequence(whole, mesh)
        key = id(local)
        self._produced[key] = weakref.ref(local, lambda _, key=key: self._produced.pop(key, None))
        return local


class CutTokenInputs(ParallelStyle):
    """Arguments of a block that hold one value per token beside the hidden states (the model
    facts' ``block_token_inputs``: Gemma 4's ``per_layer_input``), computed for the whole
    sequence before the blocks: inside the sequence-parallel region each is cut to this rank's
    slice, as the hidden states are."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._cutter = _SequenceCutter()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        signature = inspect.signature(module.forward)

        def hook(mod: nn.Module, args: tuple, kwargs: dict):
            bound = signature.bind_partial(*args, **kwargs)
            for name in self.names:
                value = bound.arguments.get(name)
                if isinstance(value, torch.Tensor):
                    bound.arguments[name] = self._cutter.cut(value, device_mesh)
            return bound.args, bound.kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ScatterSequence(_HiddenStatesHook):
    """Full (replicated) hidden states -> this rank's local sequence slice (and so the block's
    ``token_inputs``, see :class:`CutTokenInputs`). Idempotent, as :class:`_SequenceCutter` is."""

    def __init__(self, token_inputs: tuple[str, ...] = ()) -> None:
        self._cutter = _SequenceCutter()
        self.token_inputs = token_inputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.token_inputs:
            CutTokenInputs(self.token_inputs)._apply(module, device_mesh)
        return super()._apply(module, device_mesh)

    def _convert(self, hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return self._cutter.cut(hidden, mesh)


class WholeModuleParallel(ParallelStyle):
    """A module TP leaves whole that holds parameters of its own beside sub-modules (Qwen3-Next's
    Gated DeltaNet: ``A_log``, ``dt_bias``, a short convolution, projections and a gated norm).
    Every parameter of its subtree becomes a replicated DTensor, and during its forward each is
    its local tensor, so the module runs as written.

    With ``sequence_parallel`` (the module sits in the sequence-parallel region) its hidden
    states are gathered to the whole sequence first and its output cut back to this rank's
    slice: a recurrent mixer must see the whole sequence, so every TP rank computes all of it.
    In backward the output's gradient is gathered from every rank's slice, so each rank's
    parameter and input gradients are whole (no sum), and the input's is cut to its slice.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        slots = [slot for owner in module.modules() for slot in _own_slots(owner)]
        _distribute_parameters(slots, device_mesh, Replicate())
        params = _LocalDuringForward(slots)

        def swap_in(mod: nn.Module, args: tuple, kwargs: dict):
            params.swap_in()
            if not self.sequence_parallel:
                return None
            slot = _hidden_states_slot(args, kwargs)
            if slot is None:
                raise ValueError(f"{type(mod).__name__} got no hidden_states tensor to gather for sequence parallel")
            return _replace(args, kwargs, slot[0], _gather_sequence(slot[1], device_mesh))

        def swap_out(mod: nn.Module, args: tuple, kwargs: dict, output: Any):
            params.restore()
            if not self.sequence_parallel:
                return None
            return tree_map(lambda t: _cut_sequence(t, device_mesh) if isinstance(t, torch.Tensor) else t, output)

        module.register_forward_pre_hook(swap_in, with_kwargs=True)
        module.register_forward_hook(swap_out, with_kwargs=True)
        return module
