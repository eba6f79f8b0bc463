"""Rank functions for the newest model families (issue 42): GLM-4-MoE, MiniMax-M2, Gemma 4,
Llama 4, Kimi Linear, DeepSeek-V3.2, GLM-MoE-DSA and DeepSeek-V4, each through FSDP, EP (every
dispatcher), TP, CP, recompute, the chunked loss and MXFP8, several layouts in one launch
(importable by spawned ranks)."""

from __future__ import annotations

from families_jobs import DISPATCHERS, MX_PLAN
from families_jobs import reference_runs as _reference_runs
from families_jobs import mx_converted  # noqa: F401 - the test module imports it from here

from composed_jobs import matrix_run

EXPERTS = {"llama4": ["*.feed_forward.experts"], "gemma4": ["*.experts"]}  # the others: *mlp.experts
NORMS = {"llama4": ["*input_layernorm", "*post_attention_layernorm", "model.norm"],
         "gemma4": ["*layernorm", "*_norm", "*.pre_feedforward_layernorm_2", "*.post_feedforward_layernorm_1",
                    "*.post_feedforward_layernorm_2", "model.norm"]}
DEFAULT_NORMS = ["*input_layernorm", "*post_attention_layernorm", "model.norm"]
# TP on the softmax attention: q/k/v colwise, o_proj rowwise, split by head (MLA: the up-projections)
ATTENTION = {"colwise_parallel": ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj"],
             "rowwise_parallel": ["*.self_attn.o_proj"]}
MLA = {"colwise_parallel": ["*.self_attn.q_b_proj", "*.self_attn.kv_b_proj"], "rowwise_parallel": ["*.self_attn.o_proj"]}
MLA_NO_Q_LORA = {"colwise_parallel": ["*.self_attn.q_proj", "*.self_attn.kv_b_proj"],
                 "rowwise_parallel": ["*.self_attn.o_proj"]}
TP_PLANS = {"kimi_linear": MLA_NO_Q_LORA, "deepseek_v32": MLA, "glm_moe_dsa": MLA}
RECOMPUTE_CHUNK_LOSS = {"recompute": True, "recompute_policy": "full", "chunk_loss": True,
                        "chunk_loss_plan": {"chunk_size": 12}}


def _ep(kind: str, dispatcher: str) -> dict:
    # world 4, EP 2: the experts are also sharded over the other pair (efsdp 2)
    return {"expert_parallel_size": 2,
            "ep_plan": {"apply_modules": EXPERTS.get(kind, ["*mlp.experts"]), "dispatcher": dispatcher}}


def _tp(kind: str, sequence_parallel: bool) -> dict:
    plan = dict(TP_PLANS.get(kind, ATTENTION))
    if sequence_parallel:
        plan["sequence_parallel"] = NORMS.get(kind, DEFAULT_NORMS)
    return {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": plan}


def _cp(mode: str, size: int = 2, **extra) -> dict:
    plan = {"mode": mode, **({"ulysses_size": 2} if mode == "hybrid" else {}), **extra}
    return {"context_parallel_size": size, "fully_shard_parallel_size": 4 // size, "cp_plan": plan}


def family_cases(kind: str, *, moe: bool = True, cp_modes: tuple[str, ...] = ("ulysses", "ring", "hybrid"),
                 tp: bool = True) -> dict[str, tuple[str, dict]]:
    """Every layout a family goes through; CP modes its attention allows."""
    cases = {f"{kind} fsdp4": (kind, {"fully_shard_parallel_size": 4})}
    if moe:
        cases.update({f"{kind} ep2 {d}": (kind, _ep(kind, d)) for d in DISPATCHERS})
    if tp:
        cases[f"{kind} fsdp2 x tp2 sp"] = (kind, _tp(kind, sequence_parallel=True))
    for mode in cp_modes:
        size = 4 if mode == "hybrid" else 2
        cases[f"{kind} cp{size} {mode}"] = (kind, _cp(mode, size))
    cases[f"{kind} fsdp4 recompute full + chunk loss"] = (kind, {"fully_shard_parallel_size": 4,
                                                                  **RECOMPUTE_CHUNK_LOSS})
    cases[f"{kind} fsdp4 mxfp8"] = (kind, {"fully_shard_parallel_size": 4, "quantization_plan": MX_PLAN})
    if moe:
        cases[f"{kind} ep2 fused mxfp8"] = (kind, {**_ep(kind, "fused"), "quantization_plan": MX_PLAN})
    return cases


CASES: dict[str, tuple[str, dict]] = {}
for _kind in ("glm4_moe", "minimax_m2", "gemma4", "llama4"):
    CASES.update(family_cases(_kind))


def reference_runs(kinds: list[str]) -> dict:
    return _reference_runs(kinds, CASES)


def families_run(names: list[str]) -> dict:
    """Each named case in turn on these ranks (one launch for all): its train record."""
    return {name: matrix_run(*CASES[name])[0] for name in names}
