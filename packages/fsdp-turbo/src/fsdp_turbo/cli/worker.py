"""One rank of ``fsdp-turbo train`` (started by torchrun): build, resume, train, save, export.

    python -m torch.distributed.run --nproc-per-node 4 -m fsdp_turbo.cli.worker JOB.yaml
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_turbo.checkpoint import materialize, save_pretrained
from fsdp_turbo.cli.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from fsdp_turbo.cli.data import load_data
from fsdp_turbo.cli.evaluation import evaluate, items_per_rank
from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.metrics import MetricsLog, TensorBoardLog, peak_tflops, plot_loss, progress_bar
from fsdp_turbo.cli.model import build_model, fill_weights
from fsdp_turbo.cli.optim import build_optimizer, build_scheduler, clip_grad_norm
from fsdp_turbo.core.device import (
    current_device,
    detect_device_type,
    device_name,
    init_process_group,
    peak_memory_bytes,
)
from fsdp_turbo.core.logging import get_logger

_log = get_logger("fsdp_turbo.cli.worker")  # not "__main__" under python -m
# Test hooks, not settings (named so no user sets them by accident): "STEP:RANK" SIGKILLs
# (a crash) or SIGSTOPs (a peer that stops responding) that rank after that step, on the
# first attempt only; RANK "*" is every worker that has the variable (one node's, when
# only that node's agent was started with it).
KILL_ENV = "FSDP_TURBO_TEST_HOOK_KILL_AT_STEP"
STOP_ENV = "FSDP_TURBO_TEST_HOOK_STOP_AT_STEP"


# A test hook: "STEP" makes that step's loss NaN on every rank (the non-finite guards' tests).
NAN_ENV = "FSDP_TURBO_TEST_HOOK_NAN_LOSS_AT_STEP"


class NonFiniteLoss(RuntimeError):
    """A step gave a non-finite loss or gradient norm and the job was told to stop (or to skip,
    and skipped too many)."""


def _maybe_signal(step: int, rank: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    for variable, sent in ((KILL_ENV, signal.SIGKILL), (STOP_ENV, signal.SIGSTOP)):
        target = os.environ.get(variable)
        if not target:
            continue
        at_step, at_rank = target.split(":")
        if int(at_step) == step and at_rank in ("*", str(rank)):
            os.kill(os.getpid(), sent)


def _world_mean(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    # 6 N (forward + backward matmuls) + attention scores 12 L H S, as in the PaLM appendix.
    config = getattr(model, "config", None)
    params = sum(p.numel() for p in model.parameters())
    layers, hidden = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    return 6 * params + 12 * layers * hidden * seq_len


def _on_nonfinite(run, step: int, loss: float, grad_norm: float, skipped: int) -> int:
    """Stop (raise), or count the skip; returns the skips so far."""
    what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
    if run.nonfinite == "stop":
        raise NonFiniteLoss(f"{what} is not finite; stopped (run.nonfinite=stop). The last checkpoint is the "
                            "last good state: lower the learning rate, or set run.nonfinite=skip")
    skipped += 1
    _log.warning(f"{what} is not finite; step skipped ({skipped} of at most {run.max_skipped})")
    if skipped >= run.max_skipped:
        raise NonFiniteLoss(f"{skipped} steps skipped for non-finite values (run.max_skipped={run.max_skipped}); "
                            f"stopped at step {step}")
    return skipped


def train(job: JobConfig, resume: str = "auto", stop_at_step: int | None = None) -> dict:
    """Train ``job`` from its latest checkpoint (``resume``). ``stop_at_step`` ends the run
    cleanly after that step, with a checkpoint, as at the end of a time-limited allocation;
    the learning-rate schedule still spans ``run.steps``."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    run, output = job.run, Path(job.output_dir)
    # Checked before any process group: sizes, and the accumulation a global batch implies.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = run.accumulation(job.turbo.validate(world).dp_replicate_x_fsdp)
    if world > 1 and not dist.is_initialized():
        init_process_group(detect_device_type(job.turbo.device_type), run.collective_timeout_s)
        # What torchrun's agent on this node gave this worker (the device index and the
        # node layout come from these); a multi-node log shows every rank's place.
        _log.info(f"rank {dist.get_rank()}: local rank {os.environ.get('LOCAL_RANK')} of "
                  f"{os.environ.get('LOCAL_WORLD_SIZE')} on node {os.environ.get('GROUP_RANK')}", all_ranks=True)
    model = build_model(job.model)  # on the meta device
    # Before any process group: a bad data source fails here, alike on every rank.
    data = load_data(job.data, output, run.seed, vocab_size=getattr(model.config, "vocab_size", None))
    loader, held_out = data.train, data.eval
    flops_per_token = _flops_per_token(model, job.data.seq_len)
    model = FSDPTurbo(job.turbo, model)
    state = model.parallel_state
    rank0 = state.rank == 0
    checkpoint = resolve_resume(resume, output)
    if checkpoint is None:
        report = fill_weights(model, job.model, run.seed)
        if report is not None:
            _log.info(f"loaded {job.model.model_name_or_path}: this rank read {report.read_bytes / 2**20:,.1f} MiB "
                      f"of {report.checkpoint_bytes / 2**20:,.1f} MiB")
    else:
        materialize(model)  # the values come from the checkpoint below
    params = list(model.parameters())
    optimizer = build_optimizer(params, job.optimizer)
    scheduler = build_scheduler(optimizer, job.optimizer, run.steps)
    start, skipped = 0, 0
    if checkpoint is not None:
        meta = load_checkpoint(checkpoint, model, optimizer)
        scheduler.load_state_dict(meta["scheduler"])
        loader.load_state_dict(meta["data"])
        start, skipped = int(meta["step"]), int(meta.get("skipped_steps", 0))
        _log.info(f"resumed from {checkpoint} at step {start}")
    metrics = MetricsLog(output, start) if rank0 else None
    board = TensorBoardLog(output) if rank0 and job.logging.tensorboard else None
    device = current_device(state.device_type)
    peak = peak_tflops(device_name(device.type))
    tokens_per_step = run.micro_batch * state.dp_size * accumulation * job.data.seq_len
    bar = progress_bar(run.steps, start, rank0)
    last = min(run.steps, stop_at_step) if stop_at_step is not None else run.steps
    for step in range(start + 1, last + 1):
        began = time.perf_counter()
        total = torch.zeros((), device=device)
        poison = float("nan") if os.environ.get(NAN_ENV) == str(step) else 1.0
        batches = [loader.next_batch(run.micro_batch, state.dp_rank, state.dp_size) for _ in range(accumulation)]
        data_wait = time.perf_counter() - began  # the loop waits for nothing else before the forward
        items = items_per_rank(batches, device)  # the step's loss is its global token mean (see evaluation)
        for batch in batches:
            loss = model(**batch.to(device).model_inputs(), num_items_in_batch=items).loss * poison
            loss.backward()
            total += loss.detach()
        # Both are the same on every rank (a world mean, a global norm), so every rank decides alike.
        loss_value = _world_mean(total)
        grad_norm = clip_grad_norm(params, job.optimizer.grad_clip)
        lr = scheduler.get_last_lr()[0]
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        if not finite:
            skipped = _on_nonfinite(run, step, loss_value, grad_norm, skipped)
            optimizer.zero_grad(set_to_none=True)  # the step is dropped: no update
        else:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - began
        evaluation = {}
        if held_out is not None and step % job.data.eval.every == 0:
            evaluation = evaluate(model, held_out, run.micro_batch, job.data.eval.batches, state.dp_rank,
                                  state.dp_size, device)
        tokens_per_s = tokens_per_step / seconds
        tflops = flops_per_token * tokens_per_s / state.world_size / 1e12
        if rank0:
            peak_mib = peak_memory_bytes(device.type) / 2**20
            row = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": tokens_per_s, "tflops_per_rank": tflops, "peak_memory_mib": peak_mib,
                   "data_wait_s": data_wait, "step_s": seconds, "world_size": state.world_size}
            row.update(evaluation)
            if skipped:
                row.update(skipped=not finite, skipped_steps=skipped)
            if peak:
                row["mfu"] = tflops / peak
            metrics.write(row)
            if board is not None:
                board.write(row)
            shown = {"eval": f"{evaluation['eval_loss']:.4f}"} if evaluation else {}
            bar.set_postfix(loss=f"{loss_value:.4f}", **shown, tok_s=f"{tokens_per_s:,.0f}", tflops=f"{tflops:.3f}",
                            **({"mfu": f"{row['mfu']:.1%}"} if peak else {}), peak_mem=f"{peak_mib:,.0f}MiB")
            bar.update(1)
        _maybe_signal(step, state.rank)
        save_every = job.checkpoint.save_every
        if (save_every and step % save_every == 0) or step == last:
            extra = {"scheduler": scheduler.state_dict(), "data": loader.state_dict(),
                     "world_size": state.world_size, "layout": state.describe(), "skipped_steps": skipped}
            save_checkpoint(output, step, model, optimizer, extra, job.checkpoint.keep)
    bar.close()
    if board is not None:
        board.close()
    if last == run.steps:
        save_pretrained(model, output / "final")
        if rank0:
            plot_loss(output)
    return {"last_step": last, "resumed_from": start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of fsdp-turbo train")
    parser.add_argument("config")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--output-dir")
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--stop-at-step", type=int)
    args = parser.parse_args(argv)
    job = JobConfig.from_file(args.config).with_overrides(
        max_steps=args.max_steps, output_dir=args.output_dir, save_every=args.save_every)
    # DTensor's note that a 2-D (efsdp x ep) gradient norm takes two all-reduces, every step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    train(job, args.resume, args.stop_at_step)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
