"""Rank functions for ``fsdp_turbo.checkpoint`` (importable by spawned ranks)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_turbo.checkpoint import init_weights, load_pretrained, save_pretrained
from fsdp_turbo.core.testing import full_tensor, full_tensors, make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm, to_expert_lists
from fsdp_turbo.fsdp_turbo import FSDPTurbo

QKV = ["*.q_proj", "*.k_proj", "*.v_proj"]
SP = ["*layernorm", "model.norm"]
LAYOUTS = {
    "fsdp4": {"fully_shard_parallel_size": 4},
    "hsdp 2x2": {"data_parallel_size": 2},
    # sequence parallel norms and a vocab-parallel (loss-parallel) head
    "fsdp2 x tp2": {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
                    "tp_plan": {"colwise_parallel": [*QKV, "lm_head"], "rowwise_parallel": ["*.o_proj"],
                                "sequence_parallel": SP, "loss_parallel": True}},
    # experts over EP 2, sharded again over efsdp 2
    "fsdp4, ep2 x efsdp2": {"fully_shard_parallel_size": 4, "expert_parallel_size": 2, "ep_plan": {}},
    "fsdp4, ep2 eager": {"fully_shard_parallel_size": 4, "expert_parallel_size": 2, "ep_plan": {"dispatcher": "eager"}},
    "fsdp4, ep2 mc2": {"fully_shard_parallel_size": 4, "expert_parallel_size": 2, "ep_plan": {"dispatcher": "mc2"}},
    "cp2 x fsdp2": {"fully_shard_parallel_size": 2, "context_parallel_size": 2},
    "fsdp4 + mxfp8": {"fully_shard_parallel_size": 4, "quantization_plan": {"quant_format": "E4M3", "block_size": 32}},
    # MX Linears whose FSDP shards (64 and 128 rows over 2) are whole blocks gather MX bytes
    "hsdp 2x2 + mxfp8, 8-bit gathers": {"data_parallel_size": 2, "quantization_plan": {
        "quant_format": "E4M3", "block_size": 32, "low_precision_all_gather": True}},
    "fsdp4, ep2 x efsdp2 + mxfp8": {"fully_shard_parallel_size": 4, "expert_parallel_size": 2, "ep_plan": {},
                            "quantization_plan": {"quant_format": "E4M3", "block_size": 32}},
    # FSDP x TP x EP, MXFP8, selective recompute, chunked loss, both swaps (forced), compile
    "every feature": {
        "fully_shard_parallel_size": 2, "fsdp_plan": {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1},
        "tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": [*QKV, "lm_head"], "rowwise_parallel": ["*.o_proj"],
                                               "sequence_parallel": SP, "loss_parallel": True},
        "expert_parallel_size": 2, "ep_plan": {}, "quantization_plan": {"quant_format": "E4M3", "block_size": 32},
        "recompute": True, "recompute_plan": ["model.layers.0"], "recompute_policy": "selective",
        "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 12},
        "swap_activation": True, "swap_activation_plan": ["model.layers.{1-2}"], "swap_force": True,
        "swap_optimizer": True, "compile": True, "compile_backend": "aot_eager"},
}
BATCHES = make_token_batches(vocab_size=256, global_batch=8, seq_len=16, steps=3)


def _full_state(model) -> dict[str, torch.Tensor]:
    # Every rank gathers (a collective); rank 0 keeps the result.
    state = full_tensors({**model.state_dict(), **{f"buffer:{k}": v for k, v in model.named_buffers()}})
    return state if dist.get_rank() == 0 else {}


def load_then_save(kind: str, layout: str, checkpoint: str, out: str | None, model_kwargs: dict) -> dict:
    """Meta model -> FSDPTurbo -> load_pretrained; the full weights; then save_pretrained."""
    model = FSDPTurbo(LAYOUTS[layout], tiny_hf_causal_lm(kind, device="meta", **model_kwargs))
    report = load_pretrained(model, checkpoint)
    state = _full_state(model)
    if out is not None:
        save_pretrained(model, out, max_shard_size="200KB")
    return {"state": state, "read": report.read_bytes, "total": report.checkpoint_bytes}


def _batches(model):
    state = model.parallel_state
    return [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES]


def train_loaded_and_materialized(kind: str, layout: str, checkpoint: str, model_kwargs: dict) -> tuple:
    """The same run from a meta model filled by load_pretrained, and from the model built whole."""
    from transformers import AutoModelForCausalLM

    loaded = FSDPTurbo(LAYOUTS[layout], tiny_hf_causal_lm(kind, device="meta", **model_kwargs))
    load_pretrained(loaded, checkpoint)
    # from_pretrained returns the model in eval mode; both train.
    whole = FSDPTurbo(LAYOUTS[layout], AutoModelForCausalLM.from_pretrained(checkpoint).train())
    return train_steps(loaded, _batches(loaded)), train_steps(whole, _batches(whole))


def train_save_resume(kind: str, layout: str, checkpoint: str, out: str, model_kwargs: dict) -> dict:
    """Load, train, save_pretrained; the trained full weights (rank 0) to compare with the export."""
    model = FSDPTurbo(LAYOUTS[layout], tiny_hf_causal_lm(kind, device="meta", **model_kwargs))
    load_pretrained(model, checkpoint)
    train_steps(model, _batches(model))
    state = _full_state(model)
    save_pretrained(model, out, max_shard_size="200KB")
    return state


def init_on_ranks(kind: str, layout: str, seed: int, model_kwargs: dict) -> dict:
    model = FSDPTurbo(LAYOUTS[layout], tiny_hf_causal_lm(kind, device="meta", **model_kwargs))
    init_weights(model, seed=seed)
    return _full_state(model)


def init_in_one_process(kind: str, seed: int, model_kwargs: dict) -> dict:
    model = init_weights(tiny_hf_causal_lm(kind, device="meta", **model_kwargs), seed=seed)
    state = {k: full_tensor(v) for k, v in model.state_dict().items()}
    return {**state, **{f"buffer:{k}": full_tensor(v) for k, v in model.named_buffers()}}


def load_expecting_error(kind: str, checkpoint: str) -> str:
    model = FSDPTurbo(LAYOUTS["fsdp4"], tiny_hf_causal_lm(kind, device="meta"))
    load_pretrained(model, checkpoint)
    return "loaded"


def forward_before_loading(kind: str) -> str:
    model = FSDPTurbo(LAYOUTS["fsdp4"], tiny_hf_causal_lm(kind, device="meta"))
    ids = torch.zeros(1, 8, dtype=torch.long)
    model(input_ids=ids)
    return "ran"


def save_reference(kind: str, directory: Path, *, seed: int = 1, max_shard_size: str = "200KB", **model_kwargs):
    """transformers' own save of a tiny model (random init, nothing downloaded)."""
    model = tiny_hf_causal_lm(kind, seed=seed, **model_kwargs)
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, {
        f"buffer:{k}": v.detach().clone() for k, v in model.named_buffers()}


def init_peak_memory(kind: str, layout: str, model_kwargs: dict) -> dict:
    """MemTracker's peak during init_weights, against this rank's share and the largest module."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from fsdp_turbo.core.blueprint import blueprint

    model = FSDPTurbo(LAYOUTS[layout], tiny_hf_causal_lm(kind, device="meta", **model_kwargs))
    tracker = MemTracker()
    with tracker:
        init_weights(model, seed=0)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in (*model.parameters(), *model.buffers())]
    share = sum(t.numel() * t.element_size() for t in local)
    modules = blueprint(model).modules()
    largest_module = max(sum(t.numel() * t.element_size() for t in (*m.parameters(recurse=False),
                                                                      *m.buffers(recurse=False))) for m in modules)
    largest_param = max(p.numel() * p.element_size() for p in blueprint(model).parameters())
    return {"peak": peak, "share": share, "largest_module": largest_module, "largest_param": largest_param}


def expert_list_round_trip(checkpoint: str, out: str) -> dict:
    """A meta model whose experts are a ModuleList, EP=2: each rank keeps (and reads) its
    own experts' keys only; saving gathers the others' from the ranks that hold them."""
    model = FSDPTurbo(LAYOUTS["fsdp4, ep2 x efsdp2"], to_expert_lists(tiny_hf_causal_lm("qwen3_moe", device="meta")))
    report = load_pretrained(model, checkpoint)
    held = sorted(k for k in model.state_dict() if ".experts." in k)
    save_pretrained(model, out, max_shard_size="200KB")
    return {"held": held, "read": report.read_bytes, "total": report.checkpoint_bytes}
