"""FSDPTurbo side by side with torchtitan's own ``parallelize_llama`` on torchtitan 0.2.2's
Llama 3: same model, same data, same settings, same run, 4 gloo ranks.

Each rank builds the model twice from one seed (``init_weights()`` under ``no_grad``,
``attn_type="sdpa"``, float32) and parallelizes it two ways:

- ours: ``FSDPTurbo(config, model)``, patterns on torchtitan's names only;
- theirs: ``torchtitan.models.llama3.infra.parallelize.parallelize_llama(model,
  parallel_dims, job_config)``, unchanged. Its ``ParallelDims.build_mesh()`` cannot run on
  a CPU-only build: ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` when no
  accelerator is found and ``build_mesh`` calls ``init_device_mesh(device_type, ...)``. The
  benchmark first calls it as is and prints the exact error, then builds the same meshes
  with only that device type set to ``"cpu"``; ``parallelize_llama`` itself runs as
  torchtitan ships it. One more gap of the CPU build: its ``apply_fsdp`` sets every unit's
  gradient divide factor to 1.0 (its loop divides the loss by the global token count),
  which FSDP2 reduce-scatters with ``ReduceOp.PREMUL_SUM``, and gloo has none; the
  benchmark tries that op once, prints gloo's error, and sets the torchtitan model's units
  to ``set_force_sum_reduction_for_comms(True)``: a plain SUM, the same bytes.

Settings, the same on both sides (``SETTINGS`` below, printed): float32 parameters and
reductions (``MixedPrecisionPolicy(float32, float32)``); torchtitan's default FSDP units
and reshard policy (``fsdp_reshard_after_forward="default"``: the embedding and every
block reshard after forward, norm + output do not; ours: the same units, by
``fsdp_plan.apply_modules``, ``unit_groups=[["norm", "output"]]`` and
``keep_after_forward=["output"]``); no recompute, no
compile. FSDP=2 x TP=2 is torchtitan's ``apply_tp``: embedding rowwise, sequence parallel norms, q/k/v and
w1/w3 colwise, wo/w2 rowwise, the output head colwise with loss parallel, written as an
FSDPTurbo ``tp_plan``. Each side trains with its own loop convention: torchtitan sums the
cross-entropy and divides by the global token count (its FSDP does not divide gradients),
inside ``loss_parallel()``; ours takes the local mean (FSDP averages) through
``vocab_parallel_cross_entropy``. The gradients are the same; every step's loss is
checked to agree.

MoE: torchtitan's Qwen3-MoE (``parallelize_qwen3``) at FSDP=4. Its ``apply_moe_ep_tp``
cannot run on CPU (ExpertParallel's token permute is a Triton kernel; the benchmark tries
it and prints the error), so there is no EP row. Test-side settings of the CPU build, as
in the MoE peer tests: ``use_grouped_mm=False`` and ``torch.histc`` counted in float32.

Printed, each as ours / torchtitan with both raw values:
- step time: median of the paired ratios (steps alternate between the two models, each
  between barriers, after warm-up); goal <= 1.00;
- collective bytes per step, rank 0 (forward + loss + backward, counted like
  ``comm_volume.py``: all-gather = gathered output, reduce-scatter and all-reduce =
  input); goal 1.00;
- model-state bytes per rank (parameters + gradients + AdamW states, MemTracker after one
  step, the largest rank); goal <= 1.00;
- peak activation bytes per rank (MemTracker peak during forward + backward less the
  sharded parameters: activations, temporaries, gathered parameters and gradients; the
  largest rank); goal <= 1.00.

    python tools/bench/peer_torchtitan.py [--steps 12] [--layouts fsdp4 fsdp2_tp2 moe_fsdp4]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from comm_volume import CollectiveBytes  # the same byte count as the comm-volume bench
from report import result
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "peer_tests"))
from titan_moe_jobs import cpu_histc  # the peer tests' shim for the CPU build's gap

WORLD, WARMUP, ROWS, SEQ = 4, 3, 2, 128  # ROWS: sequences per data-parallel rank
# torchtitan's Llama 3 "debugmodel" (dim 256, 16 heads, vocab 2048), 4 layers, GQA 2:1.
LLAMA = {"dim": 256, "n_layers": 4, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 2048, "multiple_of": 256,
         "max_seq_len": 256, "rope_theta": 500000}
SETTINGS = ("float32 parameters and reductions on both sides (MixedPrecisionPolicy(float32, float32)); "
            "FSDP units: tok_embeddings and each of layers.* reshard after forward, the output head does not "
            "(torchtitan's fsdp_reshard_after_forward='default': one unit of norm + output; ours: the same unit, "
            "by unit_groups); no recompute, no compile, no explicit prefetch; AdamW lr 1e-4")
NORMS = ["layers.*.attention_norm", "layers.*.ffn_norm", "norm"]
# torchtitan's apply_fsdp units: the embedding, each block, then norm + output in one unit
# that keeps its parameters after forward. Ours, the same: fsdp_plan.unit_groups makes
# norm + output one unit, fsdp_plan.keep_after_forward keeps it.
FSDP_UNITS = {"apply_modules": ["tok_embeddings", "layers.*"], "unit_groups": [["norm", "output"]],
              "keep_after_forward": ["output"], "param_dtype": "float32", "reduce_dtype": "float32"}
# torchtitan's apply_tp, as an FSDPTurbo tp_plan (patterns on its names).
TITAN_APPLY_TP = {
    "colwise_parallel": ["layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv",
                         "layers.*.feed_forward.w1", "layers.*.feed_forward.w3", "output"],
    "rowwise_parallel": ["layers.*.attention.wo", "layers.*.feed_forward.w2", "tok_embeddings"],
    "sequence_parallel": NORMS, "loss_parallel": True}
# What torchtitan's model is (it has no get_output_embeddings()): said once, for every feature.
TITAN_FACTS = {"head_module": "output", "embedding_module": "tok_embeddings"}
# torchtitan's Qwen3-MoE "debugmodel_moe", smaller: 2 layers, dim 128, 8 experts top-2.
QWEN3_MOE = {"n_layers": 2, "dim": 128, "n_heads": 8, "n_kv_heads": 4, "head_dim": 16, "hidden_dim": 256,
             "moe_inter_dim": 128, "vocab_size": 2048, "max_seq_len": 256, "attn_type": "sdpa"}
MOE = {"num_experts": 8, "top_k": 2, "use_grouped_mm": False}  # grouped_mm's permute is a Triton kernel
LAYOUTS = {  # name -> (model, fsdp, tp, our config)
    "fsdp4": ("llama3", 4, 1, {"fully_shard_parallel_size": 4, "fsdp_plan": FSDP_UNITS}),
    "fsdp2_tp2": ("llama3", 2, 2, {"model_facts": TITAN_FACTS,
                                   "fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
                                   "fsdp_plan": FSDP_UNITS, "tp_plan": TITAN_APPLY_TP}),
    "moe_fsdp4": ("qwen3_moe", 4, 1, {"fully_shard_parallel_size": 4, "fsdp_plan": FSDP_UNITS}),
}


def titan_llama(seed: int = 0) -> torch.nn.Module:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(seed)
    model = Transformer(TransformerModelArgs(**LLAMA))
    with torch.no_grad():
        model.init_weights()
    return model


def titan_qwen3_moe(seed: int = 0) -> torch.nn.Module:
    import dataclasses

    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    args = dataclasses.replace(qwen3_args["debugmodel_moe"], **QWEN3_MOE)
    args.moe_args = dataclasses.replace(args.moe_args, **MOE)
    torch.manual_seed(seed)
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


MODELS = {"llama3": (titan_llama, "torchtitan.models.llama3.infra.parallelize", "parallelize_llama"),
          "qwen3_moe": (titan_qwen3_moe, "torchtitan.models.qwen3.infra.parallelize", "parallelize_qwen3")}


def _expert_parallel_failure() -> str:
    """Why torchtitan's apply_moe_ep_tp cannot run here: its ExpertParallel token dispatch
    permutes the received rows with ``_permute``, as it would on 2 EP ranks."""
    from torchtitan.models.moe.utils import _permute

    try:
        _permute(torch.zeros(8, 4), torch.full((4,), 2), 2, 2)
    except RuntimeError as error:  # printed verbatim: the reason the MoE row has no EP
        return (f"torchtitan's apply_moe_ep_tp cannot run here: its ExpertParallel token dispatch calls "
                f"torchtitan.models.moe.utils._permute, whose generate_permute_indices is a Triton kernel, and "
                f"fails: {type(error).__name__}: {error}; so the MoE row compares FSDP=4 without EP "
                f"(parallelize_qwen3 with ep=1: every block, its experts inside, one FSDP unit on both sides)")
    return "torchtitan's ExpertParallel permute ran here; this benchmark has no EP row yet"


def torchtitan_parallelized(model: torch.nn.Module, kind: str, fsdp: int, tp: int):
    """torchtitan's own path: ParallelDims + JobConfig + parallelize_llama / _qwen3. Returns the
    model, its data-parallel rank and size, and what on this machine needed adjusting, why."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=fsdp, cp=1, tp=tp, pp=1, ep=1, etp=1,
                        world_size=dist.get_world_size())
    why = None
    try:
        dims.build_mesh()
    except (AttributeError, RuntimeError) as error:  # printed verbatim: the reason for the device type below
        why = (f"torchtitan's ParallelDims.build_mesh() calls init_device_mesh("
               f"{parallel_dims_module.device_type!r}, ...) (torchtitan.tools.utils.device_type falls back to "
               f"'cuda' without an accelerator) and fails: {type(error).__name__}: {error}; so the same "
               f"build_mesh() ran with torchtitan.distributed.parallel_dims.device_type = 'cpu'")
        with mock.patch.object(parallel_dims_module, "device_type", "cpu"):
            dims.build_mesh()
    job = JobConfig()
    job.training.seq_len = SEQ
    job.training.mixed_precision_param = "float32"
    job.training.mixed_precision_reduce = "float32"
    job.parallelism.fsdp_reshard_after_forward = "default"
    job.parallelism.disable_loss_parallel = False
    job.activation_checkpoint.mode = "none"
    job.compile.enable = False
    _, module, function = MODELS[kind]
    getattr(importlib.import_module(module), function)(model, dims, job)
    sum_why = _premul_sum_failure(dims.get_mesh("fsdp").get_group(), function)
    if sum_why:
        from torch.distributed.fsdp import FSDPModule

        # Its divide factor 1.0 asks for a plain sum; FSDP2 then reduces with SUM and
        # skips the (x 1.0) scaling: the same gradients, the same bytes.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    batch = dims.get_mesh("batch")
    return model, batch.get_local_rank(), batch.size(), [w for w in (why, sum_why) if w]


def _premul_sum_failure(group, function: str) -> str | None:
    """parallelize_llama sets every FSDP unit's gradient divide factor to 1.0 (its loop
    divides the loss by the global token count); FSDP2 turns that into the reduce-scatter
    op returned here. Try it once, as FSDP2 would call it, and say why it fails if it does."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    op = _get_gradient_divide_factors(group, None, torch.float32, "cpu", factor=1.0)[2]
    try:
        dist.reduce_scatter_tensor(torch.zeros(1), torch.zeros(group.size()), op=op, group=group)
    except RuntimeError as error:  # printed verbatim: the reason for the workaround
        return (f"{function}'s apply_fsdp calls set_gradient_divide_factor(1.0) on every unit, which FSDP2 "
                f"reduce-scatters with a pre-multiplied sum (ReduceOp.PREMUL_SUM(1.0)), and "
                f"{dist.get_backend(group)} fails: {error}; so every unit of the torchtitan model is set to "
                f"set_force_sum_reduction_for_comms(True) (a plain SUM, the sum torchtitan asks for)")
    return None


def ours_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Our loop: the local mean; vocab-sharded logits go through vocab_parallel_cross_entropy."""
    from torch.distributed.tensor import DTensor

    logits = model(inputs)
    if isinstance(logits, DTensor):
        from fsdp_turbo.distributed.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits, labels)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def theirs_loss(model, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """torchtitan's loop: its summed cross-entropy over the global token count (the caller
    runs forward and backward inside loss_parallel() when TP is on)."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(model(inputs), labels) / global_tokens


class Side:
    """One parallelized model with its optimizer, loss and loop context."""

    def __init__(self, model, loss, context, loss_scale: float) -> None:
        self.model, self.loss, self.context, self.loss_scale = model, loss, context, loss_scale
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward_backward(self, inputs, labels) -> float:
        with self.context():
            loss = self.loss(self.model, inputs, labels)
            loss.backward()
        return loss.item() * self.loss_scale

    def step(self, inputs, labels) -> float:
        loss = self.forward_backward(inputs, labels)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def _timed(side: Side, inputs, labels) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    loss = side.step(inputs, labels)
    dist.barrier()
    return time.perf_counter() - started, loss


class _CountedCollectives(CollectiveBytes):
    """The comm-volume bench's byte count, plus how many collectives were called: on
    gloo each call costs a latency that bytes do not show."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        counted = name.startswith("c10d::") or (name.startswith("_c10d_functional::")
                                                 and "wait" not in name and "wrap" not in name)
        self.calls += counted
        return super().__torch_dispatch__(func, types, args, kwargs)


def _collective_bytes(side: Side, inputs, labels) -> dict[str, int]:
    counter = _CountedCollectives()
    with counter:
        side.forward_backward(inputs, labels)
    side.optimizer.step()
    side.optimizer.zero_grad(set_to_none=True)
    moved = {f"{group} {kind}": value for (group, kind), value in sorted(counter.bytes.items())}
    return {**moved, "calls": counter.calls}


def _peak_activation(side: Side, inputs, labels) -> int:
    """MemTracker's peak during forward + backward, less the sharded parameters the model
    holds anyway: activations, temporaries, gathered parameters and gradients. Not less
    its PARAM and GRAD labels (as the Ulysses bench does): MemTracker labels a gathered
    parameter PARAM or activation depending on which FSDP unit holds it, so those labels
    would compare names, not bytes."""
    from torch.distributed.tensor import DTensor

    sharded = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in side.model.parameters())
    tracker = MemTracker()
    tracker.track_external(side.model)
    with tracker:
        side.forward_backward(inputs, labels)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    side.optimizer.step()
    side.optimizer.zero_grad(set_to_none=True)
    return next(v for k, v in peak.items() if str(k) == "Total") - sharded


def _model_state(side: Side, inputs, labels) -> int:
    """Parameters + gradients + optimizer states after one step (as model_state.py)."""
    tracker = MemTracker()
    tracker.track_external(side.model, side.optimizer)
    with tracker:
        side.forward_backward(inputs, labels)
        side.optimizer.step()
        snapshot = {str(k): v for per_device in tracker.get_tracker_snapshot("current").values()
                    for k, v in per_device.items()}
    side.optimizer.zero_grad(set_to_none=True)
    return sum(snapshot.get(f"_MemRefType.{kind}", 0) for kind in ("PARAM", "GRAD", "OPT"))


def rank_main(layout: str, steps: int) -> dict:
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    from fsdp_turbo.core.testing import make_token_batches, shard_rows
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    kind, fsdp, tp, config = LAYOUTS[layout]
    build = MODELS[kind][0]
    ours_model = FSDPTurbo(config, build())
    theirs_model, dp_rank, dp_size, why = torchtitan_parallelized(build(), kind, fsdp, tp)
    if kind == "qwen3_moe":
        why.append(_expert_parallel_failure())
    state = ours_model.parallel_state
    if (dp_rank, dp_size) != (state.dp_rank, state.dp_size):
        raise RuntimeError(f"data ranks differ: torchtitan {(dp_rank, dp_size)}, ours {(state.dp_rank, state.dp_size)}")
    global_tokens = ROWS * dp_size * SEQ
    sides = {"ours": Side(ours_model, ours_loss, contextlib.nullcontext, 1.0),
             "theirs": Side(theirs_model, lambda m, i, t: theirs_loss(m, i, t, global_tokens),
                            loss_parallel if tp > 1 else contextlib.nullcontext, float(dp_size))}
    total = WARMUP + steps + 3  # + the bytes, activation and model-state steps
    batches = [shard_rows(b, dp_rank, dp_size) for b in
               make_token_batches(vocab_size=LLAMA["vocab_size"], global_batch=ROWS * dp_size, seq_len=SEQ + 1,
                                  steps=total)]
    data = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
    times = {name: [] for name in sides}
    losses = {name: [] for name in sides}
    measures = {"bytes": _collective_bytes, "activation": _peak_activation, "state": _model_state}
    out = {"times": times, "losses": losses, "why": why}
    with cpu_histc():
        for step, (inputs, labels) in enumerate(data[:WARMUP + steps]):
            for name in ("ours", "theirs") if step % 2 == 0 else ("theirs", "ours"):
                elapsed, loss = _timed(sides[name], inputs, labels)
                losses[name].append(loss)
                if step >= WARMUP:
                    times[name].append(elapsed)
        for (key, measure), (inputs, labels) in zip(measures.items(), data[WARMUP + steps:], strict=True):
            out[key] = {name: measure(side, inputs, labels) for name, side in sides.items()}
    return out


def _mib(value: float) -> str:
    return f"{value / 2**20:.3f} MiB"


def report_layout(layout: str, per_rank: list[dict]) -> None:
    first = per_rank[0]
    for ours, theirs in zip(first["losses"]["ours"], first["losses"]["theirs"], strict=True):
        if abs(ours - theirs) > 1e-4 * abs(theirs):
            raise SystemExit(f"{layout}: the two runs disagree: losses {first['losses']}")
    for why in first["why"]:
        print(f"  torchtitan on this machine: {why}")
    label = f"{layout} ({WORLD} ranks) vs torchtitan's {MODELS[LAYOUTS[layout][0]][2]}"
    times = first["times"]  # a step ends at a barrier: every rank measures the same wall time
    ours_t, theirs_t = statistics.median(times["ours"]), statistics.median(times["theirs"])
    paired = statistics.median(a / b for a, b in zip(times["ours"], times["theirs"], strict=True))
    print(f"  step time: median FSDPTurbo {ours_t * 1e3:.1f} ms, torchtitan {theirs_t * 1e3:.1f} ms over "
          f"{len(times['ours'])} steps; median paired ratio {paired:.3f} (goal <= 1.00)")
    result(f"step time, {label}", paired, "<= 1.00", f"{ours_t * 1e3:.1f} vs {theirs_t * 1e3:.1f} ms")
    moved = first["bytes"]
    calls = {name: moved[name].pop("calls") for name in ("ours", "theirs")}
    ours_b, theirs_b = sum(moved["ours"].values()), sum(moved["theirs"].values())
    print(f"  collective bytes per step, rank 0: FSDPTurbo {ours_b / 1e6:.3f} MB, torchtitan {theirs_b / 1e6:.3f} MB; "
          f"ratio {ours_b / theirs_b:.3f} (goal 1.00)")
    for name in ("ours", "theirs"):
        detail = ", ".join(f"{k}={v / 1e6:.3f} MB" for k, v in moved[name].items())
        print(f"    {name:6s} {calls[name]} calls: {detail}")
    result(f"collective bytes per step, {label}", ours_b / theirs_b, "1.00",
           f"{ours_b / 1e6:.2f} vs {theirs_b / 1e6:.2f} MB on rank 0")
    for key, what in (("state", "model-state bytes per rank (params + grads + AdamW)"),
                      ("activation", "peak activation bytes per rank")):
        ours_m, theirs_m = (max(r[key][name] for r in per_rank) for name in ("ours", "theirs"))
        print(f"  {what}, largest rank: FSDPTurbo {_mib(ours_m)}, torchtitan {_mib(theirs_m)}; "
              f"ratio {ours_m / theirs_m:.3f} (goal <= 1.00)")
        result(f"{what}, {label}", ours_m / theirs_m, "<= 1.00", f"{_mib(ours_m)} vs {_mib(theirs_m)}")


def main() -> None:
    from fsdp_turbo.core.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    print(f"torchtitan 0.2.2 Llama 3 {LLAMA}, attn sdpa; Qwen3-MoE {QWEN3_MOE} {MOE}; {WORLD} gloo ranks, "
          f"{ROWS} x {SEQ} tokens per data rank")
    print(f"settings: {SETTINGS}")
    for layout in args.layouts:
        print(f"{layout}: ours {LAYOUTS[layout][3]}")
        report_layout(layout, run_distributed(rank_main, WORLD, layout, args.steps, timeout=900))


if __name__ == "__main__":
    main()
