"""8-bit FSDP all-gathers for MX-trained weights (``quantization_plan.low_precision_all_gather``).

No MX GEMM reads a high-precision weight: the forward GEMM reads it quantized along its input
features, the input-gradient GEMM along its output features, and the weight-gradient GEMM not at
all. So FSDP can all-gather the MX bytes those GEMMs read instead of the fp32 (or bf16) weight:

- **Each rank quantizes its own fp32 shard.** FSDP shards dim 0. Blocks along another dim lie
  inside every shard; blocks along dim 0 do when every shard is a whole number of blocks, which
  the quantize transform checks (:func:`gather_unsuitable`). Then the gathered codes and scales
  are exactly those of the whole weight quantized in one process, and training is unchanged.
- **One orientation per gather**: the forward's gather carries the forward GEMM's blocks, the
  backward's gather (FSDP gathers again in backward after resharding) the input-gradient GEMM's.
  That is ``1 + 1/block`` bytes per element per gather, against 2 for bf16 and 4 for fp32.
- **The other orientation on demand**: where a module's forward runs again inside the backward
  (recompute), or FSDP keeps the weight from forward to backward (the root, or
  ``reshard_after_forward`` off), the GEMM that finds its orientation missing gathers it then,
  over the same group, from the same fp32 shards. Every rank meets the same GEMMs in the same
  order, so these collectives match.

FSDP2's extension point does the gathering: the sharded parameter's local tensor is an
:class:`MXShardedWeight` (the fp32 shard, wrapped; the optimizer and checkpoints see plain fp32),
whose ``fsdp_pre_all_gather`` returns the quantized shard, and whose ``fsdp_post_all_gather``
makes the unsharded parameter an :class:`MXGatheredWeight`: a tensor of the weight's shape that
holds only codes and scales. The MX GEMMs take their operands from it (:func:`mx_weight`).
FSDP fixes the all-gather's sizes at its first gather; both orientations have the same byte
counts (``rows * cols`` codes, ``rows * cols / block`` scales), so they share its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fsdp_turbo.core.autograd_state import in_backward
from fsdp_turbo.core.model_inspect import local_tensor
from fsdp_turbo.quantization.mx_formats.formats import get_format
from fsdp_turbo.quantization.mx_formats.mx_tensor import MXTensor, dequantize_mx, quantize_mx
from fsdp_turbo.quantization.training.fake_quant import mx_fake_quantize
from fsdp_turbo.quantization.training.recipe import MXRecipe

FORWARD, BACKWARD = "forward", "backward"
_aten = torch.ops.aten
# Ops whose results stay sharded MX weights: those FSDP shards, pads, views and moves a
# parameter with (the results are still the weight, or a piece of it). Everything else,
# the optimizer's arithmetic and a checkpoint's reads among them, sees the plain fp32 shard.
_KEEPS_WRAPPER = {
    _aten.detach.default, _aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default,
    _aten.slice.Tensor, _aten.narrow.default, _aten.split.Tensor, _aten.split_with_sizes.default,
    _aten.chunk.default, _aten.new_zeros.default, _aten.new_empty.default, _aten.empty_like.default,
    _aten.clone.default, _aten._to_copy.default, _aten.alias.default,
}


_SAME_SHAPE_VIEWS = (_aten.as_strided.default, _aten.view.default, _aten._unsafe_view.default)
_NEW_TENSORS = (_aten.empty_like.default, _aten.zeros_like.default, _aten.new_empty_strided.default,
                _aten.new_empty.default, _aten.new_zeros.default)


@dataclass(frozen=True)
class GatherSpec:
    """How one weight's blocks run: ``forward_axis`` for the forward GEMM, ``backward_axis`` for
    the input-gradient GEMM (dims of the stored weight); ``both``: every gather carries both
    (``low_precision_all_gather_mode: all``)."""

    recipe: MXRecipe
    forward_axis: int
    backward_axis: int
    both: bool = False

    def axis(self, role: str) -> int:
        return self.forward_axis if role == FORWARD else self.backward_axis


def _quantize(shard: torch.Tensor, spec: GatherSpec, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``shard`` along ``role``'s axis, both uint8 and shaped for a dim-0 gather."""
    recipe = spec.recipe
    mx = quantize_mx(shard, recipe.quant_format, recipe.block_size, recipe.scale_mode, axis=spec.axis(role),
                     emax_elem=recipe.emax_elem)
    return mx.codes, mx.scale


class MXShardedWeight(torch.Tensor):
    """The fp32 shard of an MX-trained weight, whose FSDP all-gather carries MX bytes.

    A wrapper: every op but the few that FSDP shards and moves a parameter with
    (``_KEEPS_WRAPPER``) runs on the plain shard and returns plain tensors, in-place ops in place."""

    _data: torch.Tensor
    _spec: GatherSpec

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: GatherSpec) -> MXShardedWeight:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, spec: GatherSpec) -> None:
        self._data = data
        self._spec = spec

    def __repr__(self) -> str:
        return f"MXShardedWeight({self._data!r}, {self._spec})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        spec = next(t._spec for t in _tensors(args, kwargs) if isinstance(t, MXShardedWeight))
        plain_args, plain_kwargs = tree_map_only(MXShardedWeight, lambda t: t._data, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if func._schema.is_mutable and isinstance(args[0], MXShardedWeight):
            return args[0]  # in place: the wrapper is still the weight
        if func in _KEEPS_WRAPPER:
            return tree_map_only(torch.Tensor, lambda t: MXShardedWeight(t, spec), out)
        return out

    # FSDP2's all-gather extension ------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        roles = (FORWARD, BACKWARD) if self._spec.both else (BACKWARD if in_backward() else FORWARD,)
        shard = _padded_shard(self._data, mesh.size(), outer_size)
        inputs = tuple(part for role in roles for part in _quantize(shard, self._spec, role))
        return inputs, (roles, mesh, torch.Size(outer_size))

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        roles, mesh, shape = metadata
        held = {role: (outputs[2 * i], outputs[2 * i + 1]) for i, role in enumerate(roles)}
        if out is not None:
            out = local_tensor(out, differentiable=False)  # a tensor-parallel parameter: FSDP hands the DTensor
            out._state.held = held  # FSDP gathered again: forget what was gathered on demand
            return None
        gathered = MXGatheredWeight(_GatheredState(self, mesh, self._spec), shape, param_dtype)
        gathered._state.held = held
        return gathered, tuple(outputs)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, (args, kwargs or {}))
    return found


def _padded_shard(shard: torch.Tensor, shards: int, outer_size: torch.Size) -> torch.Tensor:
    """``shard`` with FSDP's zero rows up to its padded size (``ceil(rows / shards)``): every rank
    gathers the same sizes. Zero rows are whole zero blocks (the shard size is whole blocks)."""
    padded = -(-outer_size[0] // shards)
    return F.pad(shard, (0, 0) * (shard.dim() - 1) + (0, padded - shard.shape[0])) if shard.shape[0] < padded else shard


@dataclass(eq=False)
class _GatheredState:
    """What an unsharded MX weight holds: each gathered orientation's (codes, scales), whole-
    weight shaped; where it came from, for an orientation gathered on demand."""

    source: MXShardedWeight
    mesh: object
    spec: GatherSpec
    shape: torch.Size = field(default_factory=torch.Size)
    held: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def values(self, role: str, dtype: torch.dtype) -> torch.Tensor:
        """``role``'s orientation of the whole weight, dequantized to ``dtype``."""
        if role not in self.held:
            self.held[role] = self._gather(role)
        codes, scales = self.held[role]
        rows, axis, block = self.shape[0], self.spec.axis(role), self.spec.recipe.block_size
        codes, scales = codes[:rows], scales[: rows // block if axis == 0 else rows]
        recipe = self.spec.recipe
        fmt = get_format(recipe.quant_format)
        mx = MXTensor(codes.view(fmt.data_dtype), scales, recipe.quant_format, block, axis, recipe.scale_mode,
                      recipe.emax_elem if recipe.emax_elem is not None else fmt.emax_elem, torch.float32, self.shape)
        return dequantize_mx(mx, dtype)

    def _gather(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``role``'s orientation, gathered now (see the module docstring: on demand)."""
        group, shards = self.mesh.get_group(), self.mesh.size()
        parts = _quantize(_padded_shard(self.source._data.detach(), shards, self.shape), self.spec, role)
        gathered = []
        for part in parts:
            whole = part.new_empty((part.shape[0] * shards, *part.shape[1:]))
            dist.all_gather(list(whole.chunk(shards)), part.contiguous(), group=group)
            gathered.append(whole)
        return gathered[0], gathered[1]


class MXGatheredWeight(torch.Tensor):
    """An unsharded MX-trained weight as FSDP gathered it: its shape and dtype, codes and scales
    inside; the MX GEMMs read it through :func:`mx_weight`. Autograd gives it plain gradients.
    ``transposed``: a view of the gathered weight with its last two dims swapped (fused experts
    stored ``[E, K, N]``, which their GEMMs read as ``[E, N, K]``)."""

    _state: _GatheredState
    _transposed: bool

    @staticmethod
    def __new__(cls, state: _GatheredState, shape: torch.Size, dtype: torch.dtype,
                transposed: bool = False) -> MXGatheredWeight:
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=state.source.device)

    def __init__(self, state: _GatheredState, shape: torch.Size, dtype: torch.dtype, transposed: bool = False) -> None:
        if not transposed:
            state.shape = shape
        self._state = state
        self._transposed = transposed

    def values(self, role: str) -> torch.Tensor:
        """This weight's ``role`` orientation (``FORWARD``, ``BACKWARD``), dequantized to its dtype."""
        values = self._state.values(role, self.dtype)
        return values.transpose(-2, -1) if self._transposed else values

    def __repr__(self) -> str:
        return f"MXGatheredWeight(shape={tuple(self.shape)}, holds={sorted(self._state.held)})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        this = args[0] if args and isinstance(args[0], MXGatheredWeight) else None
        if this is not None and (func in (_aten.detach.default, _aten.alias.default) or (
                func in _SAME_SHAPE_VIEWS and tuple(args[1]) == tuple(this.shape))):
            # nn.Parameter's detach, FSDP's as_strided and DTensor.to_local's view, all to the
            # weight's own shape: the same weight (one state, so FSDP's refills reach every alias)
            return MXGatheredWeight(this._state, this.shape, this.dtype, this._transposed)
        if this is not None and func is _aten.transpose.int and sorted(d % this.dim() for d in args[1:3]) == [
                this.dim() - 2, this.dim() - 1]:
            shape = (*this.shape[:-2], this.shape[-1], this.shape[-2])
            return MXGatheredWeight(this._state, torch.Size(shape), this.dtype, not this._transposed)
        if this is not None and func in _NEW_TENSORS:
            # no values needed: plain tensors (autograd's gradient buffers)
            return func(torch.empty(this.shape, dtype=this.dtype, device=this.device), *args[1:], **kwargs)
        raise NotImplementedError(
            f"{func} on an MX weight gathered as MX bytes (quantization_plan.low_precision_all_gather): only the "
            f"MX GEMMs read it. A module that reads this weight directly must not be MX-converted with "
            f"low_precision_all_gather; add it to quantization_plan.ignored_modules")


def mx_weight(weight: torch.Tensor, recipe: MXRecipe, *, backward: bool, dtype: torch.dtype | None = None,
              axis: int) -> torch.Tensor:
    """The weight as an MX GEMM reads it: quantized along ``axis`` and dequantized. A gathered
    MX weight gives the orientation it holds (``backward``: the input-gradient GEMM's);
    any other weight is quantized here."""
    if isinstance(weight, MXGatheredWeight):
        values = weight.values(BACKWARD if backward else FORWARD)
        return values if dtype is None else values.to(dtype)
    return mx_fake_quantize(weight, recipe, axis=axis, dtype=dtype)


def wrap_for_gather(module: torch.nn.Module, name: str, spec: GatherSpec) -> None:
    """Make ``module``'s parameter ``name`` gather as MX bytes (before ``fully_shard``). Its
    state dict entry stays the plain fp32 shard (checkpoints hold data, never this class)."""
    weight = getattr(module, name)
    setattr(module, name, torch.nn.Parameter(MXShardedWeight(weight.data, spec), requires_grad=weight.requires_grad))
    module.register_state_dict_post_hook(_plain_entry(name))


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with an :class:`MXShardedWeight` (a DTensor's local part, or itself) replaced by
    the plain shard it wraps: the same storage, so a load into it lands in the weight."""
    local = local_tensor(tensor, differentiable=False)
    if isinstance(tensor, DTensor) and isinstance(local, MXShardedWeight):
        with torch.no_grad():
            return DTensor.from_local(local._data, tensor.device_mesh, tensor.placements,
                                      run_check=False, shape=tensor.shape, stride=tensor.stride())
    return tensor._data if isinstance(tensor, MXShardedWeight) else tensor


def _plain_entry(name: str):
    def hook(module, state_dict, prefix, local_metadata) -> None:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = plain(state_dict[key])
    return hook
