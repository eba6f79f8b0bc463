"""Rank functions measuring one training step's memory peak with torch's MemTracker.

The step is the ``fsdp-turbo train`` step: forward with the labels (the facade's loss),
backward, gradient clipping, AdamW, ``zero_grad``. The first step runs untracked (it
creates the optimizer states and FSDP's unsharded buffers), the second is measured, so
the peak is the steady state's."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.model import build_model, fill_weights
from fsdp_turbo.cli.optim import build_optimizer, clip_grad_norm


class _NoHook:
    def remove(self) -> None:
        pass


class FrozenAwareMemTracker(MemTracker):
    """torch's MemTracker hooks every parameter's gradient, and raises on a frozen one (a LoRA
    base): frozen parameters get no hook, everything else is tracked as MemTracker does."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def _step(model, optimizer, ids: torch.Tensor, grad_clip: float | None) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    clip_grad_norm(list(model.parameters()), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measured_step_peak(job_dict: dict) -> dict[str, int | str]:
    """This rank's peak bytes in the second training step, with MemTracker's breakdown at
    that moment (``PARAM``, ``GRAD``, ``ACT``, ``OPT``, ``TEMP``, ``BUFFER``, ``OTH``)."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    job = JobConfig.from_dict(job_dict)
    model = FSDPTurbo(job.turbo, build_model(job.model, job.peft))
    fill_weights(model, job.model, job.run.seed)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], job.optimizer)
    vocab = job.model.config["vocab_size"]
    ids = torch.randint(0, vocab, (job.run.micro_batch, job.data.seq_len),
                        generator=torch.Generator().manual_seed(model.parallel_state.dp_rank))
    _step(model, optimizer, ids, job.optimizer.grad_clip)
    tracker = FrozenAwareMemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        _step(model, optimizer, ids, job.optimizer.grad_clip)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    measured = {str(kind).removeprefix("_MemRefType."): size for kind, size in peak.items()}
    return {**measured, "where": _where(tracker, measured["Total"])}


def _where(tracker: MemTracker, peak: int) -> str:
    """The innermost module whose forward or backward held the peak (for reading a miss)."""
    at = [(len(stats.mod_fqn), f"{stats.mod_fqn} {state.value}") for stats in tracker.memory_tracking.values()
          for state, snaps in stats.snapshots.items() if "Peak" in state.value
          for snap in snaps if snap.get(torch.device("cpu"), {}).get("Total") == peak]
    return max(at)[1] if at else "outside any module (the optimizer step)"


def measured_step_peaks(jobs: dict[str, dict]) -> dict[str, dict[str, int | str]]:
    """``measured_step_peak`` of each job in turn, in one launch."""
    import gc

    peaks = {}
    for name, job in jobs.items():
        peaks[name] = measured_step_peak(job)
        gc.collect()
    return peaks


LLAMA = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "moe_intermediate_size": 256, "num_experts": 8,
             "num_experts_per_tok": 2}
TP_SP = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
         "rowwise_parallel": ["*.o_proj", "*.down_proj"],
         "sequence_parallel": ["*.input_layernorm", "*.post_attention_layernorm", "model.norm"]}
EXPERTS = {"apply_modules": ["*mlp.experts"], "dispatcher": "fused"}

# name -> (model config, turbo section, peft section): every layout kind the estimate models
LAYOUTS = {
    "FSDP=4": (LLAMA, {"fully_shard_parallel_size": 4}, None),
    "FSDP=4 + full recompute": (LLAMA, {"fully_shard_parallel_size": 4, "recompute": True}, None),
    "FSDP=4 + selective recompute": (LLAMA, {"fully_shard_parallel_size": 4, "recompute": True,
                                             "recompute_policy": "selective"}, None),
    "FSDP=4 + chunked loss": (LLAMA, {"fully_shard_parallel_size": 4, "chunk_loss": True,
                                      "chunk_loss_plan": {"chunk_size": 128}}, None),
    "HSDP 2 x 2": (LLAMA, {"data_parallel_size": 2, "fully_shard_parallel_size": 2}, None),
    "FSDP=2 x TP=2 + SP": (LLAMA, {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": TP_SP}, None),
    "FSDP=2 x CP=2": (LLAMA, {"fully_shard_parallel_size": 2, "context_parallel_size": 2}, None),
    "FSDP=4 + MXFP8": (LLAMA, {"fully_shard_parallel_size": 4,
                               "quantization_plan": {"quant_format": "E4M3", "block_size": 32}}, None),
    "FSDP=4 + LoRA": (LLAMA, {"fully_shard_parallel_size": 4}, {"r": 8, "alpha": 16, "target_modules": ["*_proj"]}),
    "Qwen3-MoE FSDP=4 x EP=2": (QWEN3_MOE, {"fully_shard_parallel_size": 4, "expert_parallel_size": 2,
                                            "ep_plan": EXPERTS}, None),
    "Qwen3-MoE FSDP=4 x EP=2 + full recompute": (QWEN3_MOE, {"fully_shard_parallel_size": 4,
                                                             "expert_parallel_size": 2, "ep_plan": EXPERTS,
                                                             "recompute": True}, None),
}


def layout_job(name: str) -> dict:
    """The job of a layout: 2 sequences of 256 tokens a data shard, AdamW, gradient clipping."""
    config, turbo, peft = LAYOUTS[name]
    job = {"model": {"config": dict(config)}, "data": {"files": ["unused.txt"], "seq_len": 256},
           "optimizer": {"lr": 1e-3, "grad_clip": 1.0}, "run": {"steps": 2, "micro_batch": 2, "seed": 0},
           "output_dir": "unused", "turbo": turbo}
    return job if peft is None else {**job, "peft": peft}
