"""Rank functions for the newest model families (issue 42): GLM-4-MoE, MiniMax-M2, Gemma 4,
Llama 4, Kimi Linear, DeepSeek-V3.2, GLM-MoE-DSA and DeepSeek-V4, each through FSDP, EP (every
dispatcher), TP, CP, recompute, the chunked loss and MXFP8, several layouts in one launch
(importable by spawned ranks)."""

from __future__ import annotations

import io

import torch
from composed_jobs import MATRIX_BATCHES, labelled_loss, matrix_reference_run, matrix_run
from families_jobs import DISPATCHERS, MX_PLAN

from fsdp_turbo.core.testing import TrainRecord
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import replay_steps
from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
from fsdp_turbo.quantization.converter import convert_model

EXPERTS = {"llama4": ["*.feed_forward.experts"], "gemma4": ["*.experts"]}  # the others: *mlp.experts
# Sequence parallel's norms on the residual stream (Gemma 4's pre_feedforward_layernorm_2 acts on
# flattened tokens [T, H]: TP keeps it on each rank's tokens, with its gradient summed, by itself).
NORMS = {"gemma4": ["*input_layernorm", "*post_attention_layernorm", "*.pre_feedforward_layernorm",
                    "*.post_feedforward_layernorm", "*.post_feedforward_layernorm_1", "*.post_feedforward_layernorm_2",
                    "*.post_per_layer_input_norm", "model.norm"]}
DEFAULT_NORMS = ["*input_layernorm", "*post_attention_layernorm", "model.norm"]
# TP on the softmax attention: q/k/v colwise, o_proj rowwise, split by head (MLA: the up-projections)
ATTENTION = {"colwise_parallel": ["*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj"],
             "rowwise_parallel": ["*.self_attn.o_proj"]}
MLA = {"colwise_parallel": ["*.self_attn.q_b_proj", "*.self_attn.kv_b_proj"],
       "rowwise_parallel": ["*.self_attn.o_proj"]}
MLA_NO_Q_LORA = {"colwise_parallel": ["*.self_attn.q_proj", "*.self_attn.kv_b_proj"],
                 "rowwise_parallel": ["*.self_attn.o_proj"]}
TP_PLANS = {"kimi_linear": MLA_NO_Q_LORA, "deepseek_v32": MLA, "glm_moe_dsa": MLA}
RECOMPUTE_CHUNK_LOSS = {"recompute": True, "recompute_policy": "full", "chunk_loss": True,
                        "chunk_loss_plan": {"chunk_size": 12}}


def _ep(kind: str, dispatcher: str) -> dict:
    # at 2 ranks: the dense layers FSDP=2, each rank half of the experts
    return {"expert_parallel_size": 2,
            "ep_plan": {"apply_modules": EXPERTS.get(kind, ["*mlp.experts"]), "dispatcher": dispatcher}}


def _tp(kind: str, sequence_parallel: bool) -> dict:
    plan = dict(TP_PLANS.get(kind, ATTENTION))
    if sequence_parallel:
        plan["sequence_parallel"] = NORMS.get(kind, DEFAULT_NORMS)
    return {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": plan}


def _cp(mode: str, size: int = 2, world: int = 4, **extra) -> dict:
    plan = {"mode": mode, **({"ulysses_size": 2} if mode == "hybrid" else {}), **extra}
    return {"context_parallel_size": size, "fully_shard_parallel_size": world // size, "cp_plan": plan}


# Each case's world: 2 ranks where the layout needs no more (a case at 4 ranks on the suite's 2 cores
# costs about four times one at 2); 4 for FSDP x TP and hybrid CP.
WORLD: dict[str, int] = {}


def family_cases(kind: str, *, moe: bool = True, cp_modes: tuple[str, ...] = ("ulysses", "ring", "hybrid"),
                 tp: bool = True) -> dict[str, tuple[str, dict]]:
    """Every layout a family goes through; CP modes its attention allows. At 2 ranks: EP=2 under
    every dispatcher, CP=2 (Ulysses, ring), FSDP=2 with full recompute and the chunked loss, MXFP8
    at EP=2 (a dense family: at FSDP=2); at 4 ranks: FSDP=2 x TP=2 with sequence parallel, hybrid
    CP=4. Plain FSDP is in every layout. (Expert FSDP under MXFP8 is family-agnostic: the expert
    shards are gathered before MX quantizes them; test_integ_families runs it under every
    dispatcher, test_integ_matrix beside TP.)"""
    two, four = {}, {}
    if moe:
        two.update({f"{kind} ep2 {d}": (kind, _ep(kind, d)) for d in DISPATCHERS})
    for mode in cp_modes:
        if mode == "hybrid":
            four[f"{kind} cp4 hybrid"] = (kind, _cp(mode, 4))
        else:
            two[f"{kind} cp2 {mode}"] = (kind, _cp(mode, 2, world=2))
    two[f"{kind} fsdp2 recompute full + chunk loss"] = (kind, {"fully_shard_parallel_size": 2,
                                                                **RECOMPUTE_CHUNK_LOSS})
    if tp:
        four[f"{kind} fsdp2 x tp2 sp"] = (kind, _tp(kind, sequence_parallel=True))
    if moe:
        two[f"{kind} ep2 fused mxfp8"] = (kind, {**_ep(kind, "fused"), "quantization_plan": MX_PLAN})
    else:
        two[f"{kind} fsdp2 mxfp8"] = (kind, {"fully_shard_parallel_size": 2, "quantization_plan": MX_PLAN})
    WORLD.update({**dict.fromkeys(two, 2), **dict.fromkeys(four, 4)})
    return {**two, **four}


CASES: dict[str, tuple[str, dict]] = {}
for _kind in ("glm4_moe", "minimax_m2", "gemma4", "llama4"):
    CASES.update(family_cases(_kind))
# KDA carries a state along the sequence: Ulysses only (a ring is refused by name)
CASES.update(family_cases("kimi_linear", cp_modes=("ulysses",)))
# DeepSeek Sparse Attention: Ulysses gathers each layer's indexer keys (a ring is refused by name)
for _kind in ("deepseek_v32", "glm_moe_dsa"):
    CASES.update(family_cases(_kind, cp_modes=("ulysses",)))
# DeepSeek-V4: compressed entries from the whole sequence (Ulysses only); TP splits its MLPs and keeps
# its attention whole (on the gathered sequence under SP); only its eager attention runs
TP_PLANS["deepseek_v4"] = {"colwise_parallel": ["*.shared_experts.gate_proj", "*.shared_experts.up_proj"],
                           "rowwise_parallel": ["*.shared_experts.down_proj"]}
CASES.update(family_cases("deepseek_v4", cp_modes=("ulysses",)))
# Values narrower than queries and keys, as DeepSeek-V3's are (128 vs 192): both CP wrappers pad them
MODELS = {"deepseek_v3 narrow values": ("deepseek_v3", {"v_head_dim": 12, "num_key_value_heads": 4})}
CASES["deepseek_v3 narrow values cp2 ring"] = ("deepseek_v3 narrow values", _cp("ring", world=2))
WORLD["deepseek_v3 narrow values cp2 ring"] = 2
CASES["deepseek_v3 narrow values cp4 hybrid"] = ("deepseek_v3 narrow values", _cp("hybrid", 4))
# Gemma 4 in float64 (its experts eager: grouped GEMMs take no float64) under the layouts that sum
# in another order than one process (TP's split sums, the ring's blocks): they match to 4e-7 of the
# largest gradient, so its float32 cases' larger differences (GRAD_ATOL) are rounding
MODELS["gemma4 float64"] = ("gemma4", {"dtype": torch.float64, "experts_implementation": "eager"})
CASES["gemma4 float64 fsdp2 x tp2 sp"] = ("gemma4 float64", _tp("gemma4", sequence_parallel=True))
CASES["gemma4 float64 cp2 ring"] = ("gemma4 float64", _cp("ring", world=2))
WORLD["gemma4 float64 cp2 ring"] = 2
# KV all-gather: Llama 4's chunks (of 6, cut inside each rank's part; blocks of 2 query rows); DSA's
# indexer scoring each rank's queries against the gathered keys, its picks cutting the tiles (zig-zag
# chunks: the gathered keys put back in sequence order); DeepSeek-V4's compressor on the gathered
# sequence, its entries one more source every rank holds; and inside Ulysses
for _name, _kind, _plan in (("llama4 cp2 kv_allgather", "llama4", {"block_size": 2}),
                            ("deepseek_v32 cp2 kv_allgather", "deepseek_v32", {}),
                            ("deepseek_v4 cp2 kv_allgather", "deepseek_v4", {})):
    CASES[_name] = (_kind, _cp("kv_allgather", world=2, **_plan))
    WORLD[_name] = 2
for _kind in ("deepseek_v32", "deepseek_v4"):
    CASES[f"{_kind} cp4 ulysses2 x kv_allgather2"] = (_kind, _cp("kv_allgather", 4, ulysses_size=2))


# One launch per world size, each about the same time: one per worker of the suite
LAUNCHES = {f"{world} ranks": [name for name in CASES if WORLD.get(name, 4) == world] for world in (2, 4)}


def model_of(key: str) -> tuple[str, dict]:
    """A case's model: a tiny_hf_causal_lm kind and its config overrides."""
    return MODELS.get(key, (key, {}))


# Gemma 4 trains at a learning rate of 1e-3, not 1e-2: its norms after every sub-layer scale a
# sub-layer's last-bit differences (a split sum's order) up to the residual stream's size, so
# its first-step gradients differ by up to 1e-5 of their largest (other families: 1e-6), and at
# 1e-2 AdamW turns that into visible updates where a gradient sits at its epsilon: the
# trajectories part after two steps in every layout, FSDP=4 alone included. At 1e-3 they agree
# to 1e-6 over the four steps.
LR = {"gemma4": 1e-3, "gemma4 float64": 1e-3}
# Gemma 4's attention takes unscaled scores (scaling 1.0 on normed queries and keys) and a norm
# follows every sub-layer, so a sum in another order than one process's (TP's split sums, the
# ring's block-by-block softmax) moves a first-step gradient entry by up to 2e-6 in float32,
# where the other families stay under 1e-6; in float64 the same layouts match to 4e-7 of the
# largest gradient (the "gemma4 float64" cases, at the default atol).
GRAD_ATOL = {"gemma4": 4e-6}


def reference_runs(keys: list[str]) -> dict:
    """Each model's one-process reference, in float32 (MXFP8 cases are replayed instead)."""
    return {key: matrix_reference_run(model_of(key)[0], model_kwargs=model_of(key)[1], lr=LR.get(key, 1e-2))
            for key in keys}


def is_mx(name: str) -> bool:
    return "quantization_plan" in CASES[name][1]


def families_run(names: list[str]) -> dict:
    """Each named case in turn on these ranks (one launch for all): its train record; an MXFP8
    case's also holds its weights before each step, for :func:`mx_replay_runs`."""
    out = {}
    for name in names:
        key, config = CASES[name]
        kind, model_kwargs = model_of(key)
        out[name] = matrix_run(kind, config, model_kwargs, record_params=is_mx(name), lr=LR.get(key, 1e-2))[0]
    return out


def params_blob(records: dict[str, TrainRecord]) -> bytes:
    """The MXFP8 cases' weights (one rank's record each), saved by ``torch.save``: as bytes they
    reach a spawned process without a file descriptor per tensor."""
    blob = io.BytesIO()
    torch.save({name: record.params for name, record in records.items()}, blob)
    return blob.getvalue()


def mx_replay_runs(blob: bytes) -> dict[str, TrainRecord]:
    """MXFP8 is compared step by step: the one-process emulated-MX model replays each step from
    the case's own weights (``replay_steps``), so every step quantizes the same weights."""
    out = {}
    for name, params in torch.load(io.BytesIO(blob), weights_only=True).items():
        key, config = CASES[name]
        kind, model_kwargs = model_of(key)
        model = tiny_hf_causal_lm(kind, **model_kwargs)
        convert_model(model, QuantizeConfig(**config["quantization_plan"]))
        out[name] = replay_steps(model, MATRIX_BATCHES, params, lr=LR.get(key, 1e-2), loss_fn=labelled_loss)
    return out
