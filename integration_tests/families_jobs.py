"""Rank functions for the model families through the features (issue 32): Qwen3-Next and
Qwen3.5-MoE (Gated DeltaNet + softmax layers, MoE with a shared expert) and DeepSeek-V3 (MLA),
several layouts in one launch (importable by spawned ranks)."""

from __future__ import annotations

from composed_jobs import matrix_reference_run, matrix_run

# Linear layers and experts in MXFP8 blocks of 32 along K; what cannot take whole blocks (the
# router-sized shared_expert_gate, in_proj_b/a with 4 outputs) the converter leaves out itself.
MX_PLAN = {"quant_format": "E4M3", "block_size": 32}
MOE = ["*mlp.experts"]
DISPATCHERS = ("eager", "fused", "mc2", "domino")


def _ep(dispatcher: str) -> dict:
    # at 4 ranks the experts are also sharded over the other pair (efsdp 2); at 2 the dense
    # layers are FSDP=2
    return {"expert_parallel_size": 2, "ep_plan": {"apply_modules": MOE, "dispatcher": dispatcher}}


CASES: dict[str, tuple[str, dict]] = {}
# Each case's world: 2 ranks where the layout needs no more (on the suite's 2 cores a case at 4
# ranks costs about six times one at 2), else 4. EP with expert FSDP under every dispatcher stays
# at 4 ranks for gpt-oss in MXFP8 (below), and for DeepSeek-V3's fused dispatcher.
WORLD: dict[str, int] = {}
RECOMPUTE_CHUNK_LOSS = {"fully_shard_parallel_size": 2, "recompute": True, "recompute_policy": "full",
                       "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 12}}
for _kind in ("qwen3_next", "qwen3_5_moe"):
    CASES[f"{_kind} fsdp2"] = (_kind, {"fully_shard_parallel_size": 2})
    for _dispatcher in DISPATCHERS:
        CASES[f"{_kind} ep2 {_dispatcher}"] = (_kind, _ep(_dispatcher))
        WORLD[f"{_kind} ep2 {_dispatcher}"] = 2
    CASES[f"{_kind} fsdp4 mxfp8"] = (_kind, {"fully_shard_parallel_size": 4, "quantization_plan": MX_PLAN})
    WORLD[f"{_kind} fsdp2"] = 2
for _kind in ("qwen3_next", "qwen3_5_moe", "gpt_oss", "deepseek_v3"):
    CASES[f"{_kind} fsdp2 recompute full + chunk loss"] = (_kind, RECOMPUTE_CHUNK_LOSS)
    WORLD[f"{_kind} fsdp2 recompute full + chunk loss"] = 2
# TP on the full-attention layers; the Gated DeltaNet layers kept whole (on the gathered sequence under SP)
ATTENTION_TP = {"colwise_parallel": ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj"],
                "rowwise_parallel": ["*.self_attn.o_proj"]}
SP_NORMS = ["*input_layernorm", "*post_attention_layernorm", "model.norm"]
for _kind in ("qwen3_next", "qwen3_5_moe"):
    CASES[f"{_kind} fsdp2 x tp2 sp"] = (_kind, {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
                                                "tp_plan": {**ATTENTION_TP, "sequence_parallel": SP_NORMS}})
CASES["qwen3_next fsdp2 x tp2"] = ("qwen3_next", {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
                                                  "tp_plan": ATTENTION_TP})
CASES["deepseek_v3 fsdp2 x cp2 ulysses"] = ("deepseek_v3", {"fully_shard_parallel_size": 2, "context_parallel_size": 2})
CASES["deepseek_v3 fsdp2 x cp2 ring"] = ("deepseek_v3", {"fully_shard_parallel_size": 2, "context_parallel_size": 2,
                                                         "cp_plan": {"mode": "ring"}})
CASES["deepseek_v3 ep2 fused"] = ("deepseek_v3", _ep("fused"))
# MLA under TP: the per-head up-projections split, the latent projections and norms whole
CASES["deepseek_v3 fsdp2 x tp2 sp"] = ("deepseek_v3", {
    "fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
    "tp_plan": {"colwise_parallel": ["*.q_b_proj", "*.kv_b_proj"], "rowwise_parallel": ["*.o_proj"],
                "sequence_parallel": SP_NORMS}})
# gpt-oss: sliding-window layers (window 8 of 16 tokens) beside full ones, and per-head sinks in both
CASES["gpt_oss fsdp2 x cp2 ulysses"] = ("gpt_oss", {"fully_shard_parallel_size": 2, "context_parallel_size": 2})
CASES["gpt_oss fsdp2 x cp2 ring"] = ("gpt_oss", {"fully_shard_parallel_size": 2, "context_parallel_size": 2,
                                                 "cp_plan": {"mode": "ring"}})
CASES["gpt_oss cp4 ring contiguous"] = ("gpt_oss", {"context_parallel_size": 4,
                                                    "cp_plan": {"mode": "ring", "load_balance": False}})
CASES["gpt_oss cp4 hybrid"] = ("gpt_oss", {"context_parallel_size": 4,
                                           "cp_plan": {"mode": "hybrid", "ulysses_size": 2}})
# KV all-gather: chunks of 4 under the window of 8; then composed with EP, full recompute, the chunked
# loss and MXFP8 (the block map cuts every tile in query blocks of 2 rows)
CASES["gpt_oss cp4 kv_allgather contiguous"] = ("gpt_oss", {"context_parallel_size": 4, "cp_plan": {
    "mode": "kv_allgather", "load_balance": False, "block_size": 2}})
CASES["gpt_oss cp2 x ep2 kv_allgather recompute + chunk loss mxfp8"] = ("gpt_oss", {
    **_ep("fused"), "context_parallel_size": 2, "cp_plan": {"mode": "kv_allgather", "block_size": 2},
    "recompute": True, "recompute_policy": "full", "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 12},
    "quantization_plan": MX_PLAN})
# gpt-oss's transposed, biased experts (clamped SwiGLU) and its attention in MXFP8: FSDP, and EP with
# expert FSDP under every dispatcher
CASES["gpt_oss fsdp4 mxfp8"] = ("gpt_oss", {"fully_shard_parallel_size": 4, "quantization_plan": MX_PLAN})
for _dispatcher in DISPATCHERS:
    CASES[f"gpt_oss ep2 {_dispatcher} mxfp8"] = ("gpt_oss", {**_ep(_dispatcher), "quantization_plan": MX_PLAN})


# One launch per world size: one per worker of the suite
LAUNCHES = {f"{world} ranks": [name for name in CASES if WORLD.get(name, 4) == world] for world in (2, 4)}


def reference_runs(kinds: list[str]) -> dict:
    """The single-process references: each family in fp32, and emulated MX where a case uses it."""
    out = {}
    for kind in kinds:
        out[kind] = matrix_reference_run(kind)
        if any(k == kind and "quantization_plan" in config for k, config in CASES.values()):
            out[f"{kind} mx"] = matrix_reference_run(kind, MX_PLAN)
    return out


def families_run(names: list[str]) -> dict:
    """Each named case in turn on these ranks (one launch for all): its train record."""
    return {name: matrix_run(*CASES[name])[0] for name in names}


def mx_converted(kind: str) -> dict[str, str]:
    """Module name -> the MX class the converter put there, with ``MX_PLAN`` (one process)."""
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.converter import convert_model

    model = tiny_hf_causal_lm(kind)
    convert_model(model, QuantizeConfig(**MX_PLAN))
    return {name: type(module).__name__ for name, module in model.named_modules()
            if type(module).__name__.startswith("MX")}
