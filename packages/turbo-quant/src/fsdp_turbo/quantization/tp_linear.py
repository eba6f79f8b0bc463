"""A Linear's GEMMs on each tensor-parallel rank's shard, for modules that cannot hand ``F.linear``
a DTensor weight (MX training quantizes the local shard; QLoRA-MX dequantizes its packed bytes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_inspect import local_tensor

# (input, the weight's local shard, the bias's local tensor or None) -> output, on plain tensors
LocalLinear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def tp_linear(x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None, gemm: LocalLinear) -> DTensor:
    """Each rank runs ``gemm`` on its shard; the result carries the placement ``F.linear`` would give
    (colwise: Shard(-1); rowwise: Partial, then the bias; replicated: Replicate), so TP's styles
    redistribute it as they would a plain Linear's (sequence parallel included)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1:  # FSDP2 hands the forward the TP shard alone, on the TP mesh
        raise ConfigError("tensor_parallel", str(mesh), "shard the weight on a 1-D tensor-parallel mesh "
                          "(with FSDP2 on top, as the facade does)",
                          reason="its forward runs on one mesh dimension of shards")
    placement = weight.placements[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    out_dim = x.dim() - 1
    if isinstance(placement, Shard) and placement.dim == 0:  # colwise: out features sharded
        x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        out = gemm(x_local, weight.to_local(), local_tensor(bias))
        return DTensor.from_local(out, mesh, [Shard(out_dim)], run_check=False)
    if isinstance(placement, Shard) and placement.dim == 1:  # rowwise: in features sharded
        x_local = x.redistribute(mesh, [Shard(out_dim)]).to_local()
        out = DTensor.from_local(gemm(x_local, weight.to_local(), None), mesh, [Partial()], run_check=False)
        return out if bias is None else out + bias
    x_local = x.redistribute(mesh, [Replicate()]).to_local()
    out = gemm(x_local, weight.to_local(), local_tensor(bias))
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
