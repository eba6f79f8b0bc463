"""Rank functions for turbo-quant's multi-rank tests (importable by the spawned ranks).

They use torch's own ``parallelize_module`` and ``fully_shard``: turbo-quant is tested
alone, without turbo-distributed.
"""

from __future__ import annotations

from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
from fsdp_turbo.quantization.converter import convert_model

BATCHES = make_token_batches(vocab_size=256, global_batch=8, seq_len=32, steps=3)
PLAN = QuantizeConfig(quant_format="E4M3", block_size=32)


def reference_run():
    model = tiny_hf_causal_lm("llama", seed=0)
    convert_model(model, PLAN)
    return train_steps(model, BATCHES)


def fsdp_tp_run(dp: int, tp: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp_turbo.quantization.training import MXLinear

    model = tiny_hf_causal_lm("llama", seed=0)
    convert_model(model, PLAN)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        for layer in model.model.layers:
            parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                       "down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    assert isinstance(model.model.layers[0].mlp.down_proj, MXLinear)
    rank = dist.get_rank() // tp
    return train_steps(model, [shard_rows(b, rank, dp) for b in BATCHES])
