"""Rank functions for the gpt-oss expert-parallel tests (importable by the spawned ranks)."""

from __future__ import annotations

from fsdp_turbo.core.testing import shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

# The first MoE block's parameters whose placement the test checks: its experts (biases too)
# and the router beside them.
WATCHED = ("model.layers.0.mlp.experts.", "model.layers.0.mlp.router.")


def gpt_oss_ep_config(dispatcher: str) -> dict:
    """EP=2 over 4 ranks: experts shard over efsdp=2 within each EP rank's half."""
    return {"expert_parallel_size": 2, "fully_shard_parallel_size": 4, "ep_plan": {"dispatcher": dispatcher}}


def _placements(model) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """``name -> (local shape, placements, mesh size)`` of the watched parameters."""
    return {name: (tuple(param.to_local().shape), str(param.placements), param.device_mesh.size())
            for name, param in model.named_parameters() if name.startswith(WATCHED)}


def gpt_oss_dispatchers_run(batches, dispatchers):
    """One facade training of tiny gpt-oss per dispatcher, in this one launch: each
    ``(dispatcher, record, placements, experts class name)``."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = []
    for dispatcher in dispatchers:
        model = FSDPTurbo(gpt_oss_ep_config(dispatcher), tiny_hf_causal_lm("gpt_oss"))
        state = model.parallel_state
        placements = _placements(model)
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in batches])
        experts_class = type(model.get_submodule("model.layers.0.mlp.experts")).__name__
        results.append((dispatcher, record, placements, experts_class))
    return results
