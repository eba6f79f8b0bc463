"""One rank of ``fsdp-turbo train`` (started by torchrun): build, resume, train, save, export.

    python -m torch.distributed.run --nproc-per-node 4 -m fsdp_turbo.cli.worker JOB.yaml

Whatever one rank can fail at alone (a file its node cannot read, a rank-0 write, a batch)
is followed by an all-ranks agreement (``core.agreement``): every rank then stops at
once with that rank's message, instead of waiting in its next collective for the timeout.
Everything that can be checked before step 1 is checked before step 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_turbo.checkpoint import materialize, save_pretrained
from fsdp_turbo.cli import faults as fault_injection
from fsdp_turbo.cli.checkpoint import Resume, load_checkpoint, new_run_id, resolve_resume, save_checkpoint
from fsdp_turbo.cli.data import EvalSet, TrainStream, load_data
from fsdp_turbo.cli.evaluation import check_eval_set, evaluate, items_per_rank
from fsdp_turbo.cli.flops import flops_per_token
from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.metrics import MetricsLog, TensorBoardLog, peak_tflops, plot_loss, progress_bar
from fsdp_turbo.cli.model import build_model, fill_weights
from fsdp_turbo.cli.optim import build_optimizer, build_scheduler, clip_grad_norm
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.device import (
    current_device,
    detect_device_type,
    device_name,
    end_process,
    init_process_group,
    peak_memory_bytes,
)
from fsdp_turbo.core.failfast import FailFast
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.parallel_state import ParallelState

_log = get_logger("fsdp_turbo.cli.worker")  # not "__main__" under python -m


class NonFiniteLoss(RuntimeError):
    """A step gave a non-finite loss or gradient norm and the job was told to stop (or to skip,
    and skipped too many)."""


def _world_mean(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


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


def _same_on_every_rank(value: str) -> str:
    """Rank 0's ``value`` (a run id made from the clock and random bits) on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Session:
    """A training run once it is set up: what every step uses."""

    job: JobConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: TrainStream
    held_out: EvalSet | None
    state: ParallelState
    device: torch.device
    run_id: str
    start: int  # the last step already done (0 for a fresh start)
    skipped: int
    accumulation: int
    flops_per_token: float
    faults: fault_injection.Faults | None
    metrics: MetricsLog | None = None  # rank 0
    board: TensorBoardLog | None = None  # rank 0, when asked for

    @property
    def rank0(self) -> bool:
        return self.state.rank == 0


def _resume_point(job: JobConfig, resume: str, device: torch.device) -> Resume:
    fresh = _same_on_every_rank(new_run_id())
    with every_rank_or_none("find the checkpoint to resume", device):
        point = resolve_resume(resume, job.output_dir, fresh)
    _log.info(point.note)
    return point


def _setup(job: JobConfig, resume: str, accumulation: int, faults) -> Session:
    """Everything before step 1, each part agreed on by every rank."""
    run, output = job.run, Path(job.output_dir)
    device = current_device(detect_device_type(job.turbo.device_type))
    with every_rank_or_none("build the model", device):
        model = build_model(job.model)  # on the meta device
    with every_rank_or_none("load the data", device):
        data = load_data(job.data, output, run.seed, vocab_size=getattr(model.config, "vocab_size", None))
    tokens_flops = flops_per_token(model, job.data.seq_len)
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(job.turbo, model)
    state = model.parallel_state
    point = _resume_point(job, resume, device)
    if point.checkpoint is None:
        report = fill_weights(model, job.model, run.seed)
        if report is not None:
            _log.info(f"loaded {job.model.model_name_or_path}: this rank read {report.read_bytes / 2**20:,.1f} MiB "
                      f"of {report.checkpoint_bytes / 2**20:,.1f} MiB")
    else:
        materialize(model)  # the values come from the checkpoint below
    optimizer = build_optimizer(list(model.parameters()), job.optimizer)
    scheduler = build_scheduler(optimizer, job.optimizer, run.steps)
    session = Session(job, model, optimizer, scheduler, data.train, data.eval, state, device, point.run, 0, 0,
                      accumulation, tokens_flops, faults)
    if point.checkpoint is not None:
        meta = load_checkpoint(point.checkpoint, model, optimizer, device)
        with every_rank_or_none("resume", device):
            scheduler.load_state_dict(meta["scheduler"])
            session.loader.load_state_dict(meta["data"])
            session.start, session.skipped = int(meta["step"]), int(meta.get("skipped_steps", 0))
        _log.info(f"resumed from {point.checkpoint} at step {session.start}")
    if session.held_out is not None:  # a set too small, or without loss, fails now, not at the first evaluation
        check_eval_set(session.held_out, run.micro_batch, job.data.eval.batches, state.dp_rank, state.dp_size, device)
    with every_rank_or_none("open the logs", device):
        if session.rank0:
            session.metrics = MetricsLog(output, session.start)
            session.board = TensorBoardLog(output) if job.logging.tensorboard else None
    return session


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    finite: bool
    data_wait_s: float
    step_s: float


def _train_step(session: Session, step: int) -> StepResult:
    job, state, device = session.job, session.state, session.device
    began = time.perf_counter()
    total = torch.zeros((), device=device)
    with every_rank_or_none(f"read the batches of step {step}", device):
        batches = [session.loader.next_batch(job.run.micro_batch, state.dp_rank, state.dp_size)
                   for _ in range(session.accumulation)]
    data_wait = time.perf_counter() - began  # the loop waits for nothing else before the forward
    items = items_per_rank(batches, device)  # the step's loss is its global token mean (see evaluation)
    poisoned = session.faults is not None and session.faults.nan_loss(step)
    for batch in batches:
        loss = session.model(**batch.to(device).model_inputs(), num_items_in_batch=items).loss
        if poisoned:
            loss = loss * float("nan")
        loss.backward()
        total += loss.detach()
    # Both are the same on every rank (a world mean, a global norm), so every rank decides alike.
    loss_value = _world_mean(total)
    grad_norm = clip_grad_norm(list(session.model.parameters()), job.optimizer.grad_clip)
    lr = session.scheduler.get_last_lr()[0]
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
    if not finite:
        session.skipped = _on_nonfinite(job.run, step, loss_value, grad_norm, session.skipped)
    else:
        session.optimizer.step()
        session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)  # a dropped step leaves no update behind
    return StepResult(loss_value, grad_norm, lr, finite, data_wait, time.perf_counter() - began)


def _metrics_row(session: Session, step: int, result: StepResult, evaluation: dict[str, float]) -> dict[str, Any]:
    job, state = session.job, session.state
    tokens_per_step = job.run.micro_batch * state.dp_size * session.accumulation * job.data.seq_len
    tokens_per_s = tokens_per_step / result.step_s
    tflops = session.flops_per_token * tokens_per_s / state.world_size / 1e12
    row = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
           "tokens_per_s": tokens_per_s, "tflops_per_rank": tflops,
           "peak_memory_mib": peak_memory_bytes(session.device.type) / 2**20,
           "data_wait_s": result.data_wait_s, "step_s": result.step_s, "world_size": state.world_size}
    row.update(evaluation)
    if session.skipped:
        row.update(skipped=not result.finite, skipped_steps=session.skipped)
    peak = peak_tflops(device_name(session.device.type))
    if peak:
        row["mfu"] = tflops / peak
    return row


def _report(session: Session, step: int, row: dict[str, Any], bar) -> None:
    """Rank 0 writes the row (metrics.jsonl, TensorBoard, the bar); every rank agrees it did."""
    with every_rank_or_none(f"write the metrics of step {step}", session.device):
        if session.rank0:
            session.metrics.write(row)
            if session.board is not None:
                session.board.write(row)
            shown = {"eval": f"{row['eval_loss']:.4f}"} if "eval_loss" in row else {}
            if "mfu" in row:
                shown["mfu"] = f"{row['mfu']:.1%}"
            bar.set_postfix(loss=f"{row['loss']:.4f}", **shown, tok_s=f"{row['tokens_per_s']:,.0f}",
                            tflops=f"{row['tflops_per_rank']:.3f}", peak_mem=f"{row['peak_memory_mib']:,.0f}MiB")
            bar.update(1)


def _save(session: Session, step: int) -> None:
    loader, state = session.loader, session.state
    extra = {"scheduler": session.scheduler.state_dict(), "data": loader.state_dict(),
             "world_size": state.world_size, "layout": state.describe(), "skipped_steps": session.skipped}
    crash = session.faults is not None and session.faults.crash_during_save(step)
    save_checkpoint(session.job.output_dir, session.run_id, step, session.model, session.optimizer, extra,
                    session.job.checkpoint.keep, session.device, crash_after_shards=crash)


def _finish(session: Session) -> None:
    """The end of the whole job: the model in transformers' layout, and the loss plot."""
    output = Path(session.job.output_dir)
    save_pretrained(session.model, output / "final")
    with every_rank_or_none("plot the loss", session.device):
        if session.rank0:
            plot_loss(output)


def train(job: JobConfig, resume: str = "auto", stop_at_step: int | None = None) -> dict:
    """Train ``job`` from its latest checkpoint (``resume``). ``stop_at_step`` ends the run
    cleanly after that step, with a checkpoint, as at the end of a time-limited allocation;
    the learning-rate schedule still spans ``run.steps``."""
    run = job.run
    # Checked before any process group: sizes, the accumulation a global batch implies, and
    # the fault-injection variable (tests only; see cli.faults).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = run.accumulation(job.turbo.validate(world).dp_replicate_x_fsdp)
    faults = fault_injection.arm()
    watch = None
    if world > 1 and not dist.is_initialized():
        init_process_group(detect_device_type(job.turbo.device_type), run.collective_timeout_s)
        # What torchrun's agent on this node gave this worker (the device index and the
        # node layout come from these); a multi-node log shows every rank's place.
        _log.info(f"rank {dist.get_rank()}: local rank {os.environ.get('LOCAL_RANK')} of "
                  f"{os.environ.get('LOCAL_WORLD_SIZE')} on node {os.environ.get('GROUP_RANK')}", all_ranks=True)
        watch = FailFast.from_environment()  # a group this worker made: its errors end every rank at once
    try:
        result = _run(job, resume, stop_at_step, accumulation, faults)
    except BaseException as error:
        if watch is not None:
            watch.post(error)
        raise
    if watch is not None:
        watch.close()
        dist.barrier()  # no rank's watcher is still looking when rank 0 exits with the store
    return result


def _run(job: JobConfig, resume: str, stop_at_step: int | None, accumulation: int, faults) -> dict:
    run = job.run
    session = _setup(job, resume, accumulation, faults)
    bar = progress_bar(run.steps, session.start, session.rank0)
    last = min(run.steps, stop_at_step) if stop_at_step is not None else run.steps
    for step in range(session.start + 1, last + 1):
        result = _train_step(session, step)
        evaluation = {}
        if session.held_out is not None and step % job.data.eval.every == 0:
            state = session.state
            evaluation = evaluate(session.model, session.held_out, run.micro_batch, job.data.eval.batches,
                                  state.dp_rank, state.dp_size, session.device)
        _report(session, step, _metrics_row(session, step, result, evaluation), bar)
        if faults is not None:
            faults.after_step(step, session.state.rank)
        save_every = job.checkpoint.save_every
        if (save_every and step % save_every == 0) or step == last:
            _save(session, step)
    bar.close()
    if session.board is not None:
        session.board.close()
    if last == run.steps:
        _finish(session)
    return {"last_step": last, "resumed_from": session.start, "run": session.run_id}


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
    end_process(0)


if __name__ == "__main__":
    main()
