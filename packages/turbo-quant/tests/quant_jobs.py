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


# low_precision_all_gather: a model whose MX Linears carry most of the bytes, as in real models
# (every FSDP shard of 4 is whole blocks of 32 rows: out_features 256 and 512)
GATHER_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_key_value_heads": 4, "head_dim": 64}
GATHER_BATCHES = make_token_batches(vocab_size=256, global_batch=4, seq_len=32, steps=3)  # one block per rank
GATHER_VARIANTS = {  # name: (MX bytes?, mode "all"?, recompute?, param_dtype)
    "fp32 gather": (False, False, False, None),
    "bf16 gather": (False, False, False, "bfloat16"),
    "mx on-demand": (True, False, False, None),
    "mx on-demand + recompute": (True, False, True, None),
    "mx all": (True, True, False, None),
}


def gather_reference_run():
    model = tiny_hf_causal_lm("llama", seed=0, **GATHER_MODEL)
    convert_model(model, PLAN)
    return train_steps(model, GATHER_BATCHES)


def gather_variants_run():
    """Every ``GATHER_VARIANTS`` entry on the same 4-rank FSDP mesh: (record, bytes this rank
    received in all-gathers, weights gathered as MX bytes) by name."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_turbo.core.testing.collectives import AllGatherBytes
    from fsdp_turbo.quantization.gather_plan import GatheredWeight, apply_gathers
    from fsdp_turbo.quantization.training import MXLinear, MXRecipe
    from fsdp_turbo.quantization.training.mx_gather import MXShardedWeight

    mesh = init_device_mesh("cpu", (4,))
    batches = [shard_rows(b, dist.get_rank(), 4) for b in GATHER_BATCHES]
    out = {}
    for name, (mx_bytes, both, recompute, dtype) in GATHER_VARIANTS.items():
        model = tiny_hf_causal_lm("llama", seed=0, **GATHER_MODEL)
        convert_model(model, PLAN)
        if mx_bytes:
            weights = [GatheredWeight(f"{n}.weight", 1, 0) for n, m in model.named_modules() if isinstance(m, MXLinear)]
            apply_gathers(model, weights, MXRecipe.from_config(PLAN), both=both)
        layers = model.model.layers
        if recompute:
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype) if dtype else None)
        for layer in layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        wrapped = sum(isinstance(p.to_local(), MXShardedWeight) for p in model.parameters())
        with AllGatherBytes() as gathers:
            record = train_steps(model, batches)
        out[name] = (record, gathers.received, wrapped)
    return out
