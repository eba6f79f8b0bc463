"""One rank of ``fsdp-turbo train`` (started by torchrun): build, resume, train, save, export.

    python -m torch.distributed.run --nproc-per-node 4 -m fsdp_turbo.cli.worker JOB.yaml

Started by ``fsdp-turbo train``, a worker takes the job the launcher resolved (overrides
applied, checked; ``cli.resolved_job``); started by torchrun directly, the job file as it is.

The steps, in order: setup (sizes, process group, fault hooks), model, data, parallelize,
weights, optimizer, resume, then the loop (train step, eval, report, save) and the finish
(the model in transformers' layout, the loss plot).

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

from fsdp_turbo.checkpoint import TrainingCheckpointer, materialize, save_pretrained
from fsdp_turbo.cli import faults as fault_injection
from fsdp_turbo.cli import preemption
from fsdp_turbo.cli.checkpoint import Resume, load_checkpoint, new_run_id, resolve_resume, save_checkpoint
from fsdp_turbo.cli.data import Batch, EvalSet, JobData, TrainStream, load_data
from fsdp_turbo.cli.evaluation import check_eval_set, evaluate, items_per_rank, pipeline_inputs
from fsdp_turbo.cli.flops import flops_per_token
from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.metrics import MetricsLog, Progress, TensorBoardLog, peak_tflops, plot_loss, progress
from fsdp_turbo.cli.model import build_model, fill_weights
from fsdp_turbo.cli.optim import build_optimizer, build_scheduler, clip_grad_norm
from fsdp_turbo.cli.resolved_job import load_job
from fsdp_turbo.cli.sizes import JobSizes, job_sizes
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.blueprint import blueprint
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
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.moe_telemetry import MoETelemetry, telemetry_of
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.stage_part import stage_parts

_log = get_logger("fsdp_turbo.cli.worker")  # not "__main__" under python -m
_REPORT_GRACE_S = 2.0  # ``rank_main``: twenty of the agent's default monitor intervals (0.1 s)


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
    sizes: JobSizes
    flops_per_token: float
    hooks: fault_injection.Hooks
    saver: TrainingCheckpointer  # sync, or one save at a time in the background (checkpoint.async_save)
    notice: preemption.WorkerNotice  # the preemption signals this rank got
    start: int = 0  # the last step already done (0 for a fresh start)
    skipped: int = 0
    metrics: MetricsLog | None = None  # rank 0
    board: TensorBoardLog | None = None  # rank 0, when asked for
    moe: MoETelemetry | None = None  # an MoE model's routing, read into every metrics row

    @property
    def rank0(self) -> bool:
        return self.state.rank == 0


# ----- setup ---------------------------------------------------------------------------------


def _start_group(job: JobConfig, world: int) -> FailFast | None:
    """The process group of a launched job, and the watch that ends every rank at once on one
    rank's error; ``None`` without one (one process, or a group the caller made)."""
    if world == 1 or dist.is_initialized():
        return None
    init_process_group(detect_device_type(job.turbo.device_type), job.run.collective_timeout_s)
    # What torchrun's agent on this node gave this worker (the device index and the node
    # layout come from these); a multi-node log shows every rank's place.
    _log.info(f"rank {dist.get_rank()}: local rank {os.environ.get('LOCAL_RANK')} of "
              f"{os.environ.get('LOCAL_WORLD_SIZE')} on node {os.environ.get('GROUP_RANK')}", all_ranks=True)
    return FailFast.from_environment()


def _end_group(watch: FailFast | None) -> None:
    if watch is not None:
        watch.close()
        dist.barrier()  # no rank's watcher is still looking when rank 0 exits with the store


# ----- model, data, optimizer, resume ---------------------------------------------------------


def _model(job: JobConfig, device: torch.device) -> torch.nn.Module:
    with every_rank_or_none("build the model", device):
        return build_model(job.model, job.peft)  # on the meta device


def _data(job: JobConfig, model: torch.nn.Module, device: torch.device) -> JobData:
    facts = model.fsdp_turbo_facts
    with every_rank_or_none("load the data", device):
        return load_data(job.data, Path(job.output_dir), job.run.seed, vocab_size=facts.sizes.vocab or None,
                         ignore_index=facts.ignore_index)


def _parallelize(job: JobConfig, model: torch.nn.Module) -> torch.nn.Module:
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    return FSDPTurbo(job.turbo, model)


def _whole_facts(model: torch.nn.Module) -> ModelFacts:
    """The facts of the whole model (a pipeline's first stage has its own, of its layers)."""
    runner = getattr(model, "fsdp_turbo_pipeline", None)
    return runner.plan.model_facts if runner is not None else model.fsdp_turbo_facts


def _resume_point(job: JobConfig, resume: str, device: torch.device) -> Resume:
    fresh = _same_on_every_rank(new_run_id())
    with every_rank_or_none("find the checkpoint to resume", device):
        point = resolve_resume(resume, job.output_dir, fresh)
    _log.info(point.note)
    return point


def _weights(job: JobConfig, model: torch.nn.Module, point: Resume) -> None:
    """The starting weights: the job's (a checkpoint folder, or ``init_weights``), or none yet
    when a training checkpoint is resumed (its values are loaded over these). Training
    checkpoints hold trainable parameters only, so frozen ones (a LoRA model's base) are read
    from the job's source on resume too: they never change."""
    if point.checkpoint is not None and all(p.requires_grad for p in _parameters(model)):
        materialize(model)
        return
    report = fill_weights(model, job.model, job.run.seed)
    if report is not None:
        _log.info(f"loaded {job.model.model_name_or_path}: this rank read {report.read_bytes / 2**20:,.1f} MiB "
                  f"of {report.checkpoint_bytes / 2**20:,.1f} MiB")


def _parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """This rank's parameters: the model's, or those of every pipeline stage it holds."""
    return [p for part in stage_parts(model) for p in part.parameters()]


def _optimizer(job: JobConfig, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    # only what trains: frozen parameters (a LoRA model's base) get no optimizer state
    optimizer = build_optimizer([p for p in _parameters(model) if p.requires_grad], job.optimizer)
    return optimizer, build_scheduler(optimizer, job.optimizer, job.run.steps)


def _resume(session: Session, point: Resume) -> None:
    """Model, optimizer, schedule, data position and step from the training checkpoint, if any."""
    if point.checkpoint is None:
        return
    meta = load_checkpoint(point.checkpoint, session.model, session.optimizer, session.device)
    with every_rank_or_none("resume", session.device):
        session.scheduler.load_state_dict(meta["scheduler"])
        session.loader.load_state_dict(meta["data"])
        session.start, session.skipped = int(meta["step"]), int(meta.get("skipped_steps", 0))
    _log.info(f"resumed from {point.checkpoint} at step {session.start}")


def _check_eval(session: Session) -> None:
    """A held-out set too small, or without loss, fails now, not at the first evaluation."""
    if session.held_out is not None:
        state = session.state
        check_eval_set(session.held_out, session.job.run.micro_batch, session.job.data.eval.batches,
                       state.dp_rank, state.dp_size, session.device)


def _open_logs(session: Session) -> None:
    output = Path(session.job.output_dir)
    with every_rank_or_none("open the logs", session.device):
        if session.rank0:
            session.metrics = MetricsLog(output, session.start)
            session.board = TensorBoardLog(output) if session.job.logging.tensorboard else None


def _setup(job: JobConfig, resume: str, sizes: JobSizes, hooks: fault_injection.Hooks,
           notice: preemption.WorkerNotice) -> Session:
    """Everything before step 1, each part agreed on by every rank."""
    device = current_device(detect_device_type(job.turbo.device_type))
    model = _parallelize(job, _model(job, device))
    data = _data(job, model, device)
    # of the model as built (its blueprint: a meta copy from before any transform)
    tokens_flops = flops_per_token(blueprint(model), _whole_facts(model), job.data.seq_len)
    point = _resume_point(job, resume, device)
    _weights(job, model, point)
    optimizer, scheduler = _optimizer(job, model)
    saver = TrainingCheckpointer(async_save=job.checkpoint.async_save, device=device,
                                 timeout_s=job.run.collective_timeout_s)
    session = Session(job, model, optimizer, scheduler, data.train, data.eval, model.parallel_state, device,
                      point.run, sizes, tokens_flops, hooks, saver, notice, moe=telemetry_of(model))
    _resume(session, point)
    _check_eval(session)
    _open_logs(session)
    return session


# ----- the loop: train step, eval, report, save ------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    finite: bool
    data_wait_s: float
    step_s: float


def _batches(session: Session, step: int) -> list[Batch]:
    """This shard's micro-batches of ``step``."""
    state, micro_batch = session.state, session.job.run.micro_batch
    with every_rank_or_none(f"read the batches of step {step}", session.device):
        return [session.loader.next_batch(micro_batch, state.dp_rank, state.dp_size)
                for _ in range(session.sizes.accumulation)]


def _forward_backward(session: Session, step: int, batches: list[Batch]) -> float:
    """Gradients of the step's loss, accumulated; the loss, the same on every rank."""
    device = session.device
    items = items_per_rank(batches, device)  # the step's loss is its global token mean (see evaluation)
    runner = getattr(session.model, "fsdp_turbo_pipeline", None)
    if runner is not None:  # the step's micro-batches are the pipeline's batch: one schedule step
        whole = _joined([batch.to(device) for batch in batches])
        loss = session.hooks.on_loss(step, runner.step(**whole, num_items_in_batch=items))
        return _world_mean(loss)
    total = torch.zeros((), device=device)
    for batch in batches:
        loss = session.model(**batch.to(device).model_inputs(), num_items_in_batch=items).loss
        loss = session.hooks.on_loss(step, loss)
        loss.backward()
        total += loss.detach()
    return _world_mean(total)


def _joined(batches: list[Batch]) -> dict[str, torch.Tensor]:
    """The batches' rows as one batch, as a pipeline's ``step`` takes it."""
    inputs = [pipeline_inputs(batch) for batch in batches]
    return {name: torch.cat([each[name] for each in inputs]) for name in inputs[0]}


def _update(session: Session, step: int, loss: float, grad_norm: float) -> bool:
    """The optimizer and schedule step, or a skip (or stop) for a non-finite step; whether it
    was finite. Loss and norm are the same on every rank, so every rank decides alike."""
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        session.optimizer.step()
        session.scheduler.step()
    else:
        session.skipped = _on_nonfinite(session.job.run, step, loss, grad_norm, session.skipped)
    session.optimizer.zero_grad(set_to_none=True)  # a dropped step leaves no update behind
    return finite


def _train_step(session: Session, step: int) -> StepResult:
    began = time.perf_counter()
    batches = _batches(session, step)
    data_wait = time.perf_counter() - began  # the loop waits for nothing else before the forward
    loss = _forward_backward(session, step, batches)
    grad_norm = clip_grad_norm(_parameters(session.model), session.job.optimizer.grad_clip,
                               _pipeline_group(session.state))
    lr = session.scheduler.get_last_lr()[0]
    finite = _update(session, step, loss, grad_norm)
    return StepResult(loss, grad_norm, lr, finite, data_wait, time.perf_counter() - began)


def _pipeline_group(state: ParallelState) -> dist.ProcessGroup | None:
    """The ranks holding the other stages of this rank's pipeline (None without one)."""
    return state.group("pp") if state.pp_size > 1 else None


def _eval(session: Session, step: int) -> dict[str, float]:
    """The held-out loss where ``step`` is an evaluation step; else nothing."""
    job, state = session.job, session.state
    if session.held_out is None or step % job.data.eval.every:
        return {}
    return evaluate(session.model, session.held_out, job.run.micro_batch, job.data.eval.batches,
                    state.dp_rank, state.dp_size, session.device)


def _metrics_row(session: Session, step: int, result: StepResult, evaluation: dict[str, float]) -> dict[str, Any]:
    state = session.state
    tokens_per_s = session.sizes.rows_per_step * session.job.data.seq_len / result.step_s
    tflops = session.flops_per_token * tokens_per_s / state.world_size / 1e12
    row = {"step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
           "tokens_per_s": tokens_per_s, "tflops_per_rank": tflops,
           "peak_memory_mib": peak_memory_bytes(session.device.type) / 2**20,
           "data_wait_s": result.data_wait_s, "step_s": result.step_s, "world_size": state.world_size}
    row.update(evaluation)
    if session.moe is not None:  # every rank: the counts are summed over them
        row.update(session.moe.read(session.device))
    if session.skipped:
        row.update(skipped=not result.finite, skipped_steps=session.skipped)
    peak = peak_tflops(device_name(session.device.type))
    if peak:
        row["mfu"] = tflops / peak
    return row


def _report(session: Session, step: int, row: dict[str, Any], shown: Progress) -> None:
    """Rank 0 writes the row (metrics.jsonl, TensorBoard, the progress); every rank agrees it did."""
    with every_rank_or_none(f"write the metrics of step {step}", session.device):
        if session.rank0:
            session.metrics.write(row)
            if session.board is not None:
                session.board.write(row)
            shown.show(row)


def _save_due(job: JobConfig, step: int, last: int) -> bool:
    save_every = job.checkpoint.save_every
    return bool(save_every and step % save_every == 0) or step == last


def _save(session: Session, step: int) -> None:
    """The checkpoint of ``step``; rank 0 logs how long the loop waited for it (in the background:
    for the save before it, and to stage this one)."""
    loader, state = session.loader, session.state
    extra = {"scheduler": session.scheduler.state_dict(), "data": loader.state_dict(),
             "world_size": state.world_size, "layout": state.describe(), "skipped_steps": session.skipped}
    began = time.perf_counter()
    save_checkpoint(session.saver, session.job.output_dir, session.run_id, step, session.model, session.optimizer,
                    extra, session.job.checkpoint.keep, **session.hooks.save_options(step))
    how = "staged, written in the background" if session.saver.async_save else "written"
    _log.info(f"checkpoint of step {step} {how}: the loop waited {time.perf_counter() - began:.2f} s")


def _loop(session: Session, last: int) -> int:
    """Steps ``start + 1`` to ``last``: train, evaluate, report, let the hooks in, save; after
    each, the ranks agree whether a preemption signal came (then: save, stop). Returns the last
    step done."""
    job = session.job
    shown = progress(job.run.steps, session.start, last, enabled=session.rank0, every=job.logging.every)
    done = session.start
    began = time.perf_counter()
    for step in range(session.start + 1, last + 1):
        result = _train_step(session, step)
        _report(session, step, _metrics_row(session, step, result, _eval(session, step)), shown)
        session.hooks.after_step(step, session.state.rank)
        done = step
        saved = _save_due(job, step, last)
        if saved:
            _save(session, step)
        why = session.notice.agreed(session.device)
        if why is not None:
            if not saved:
                _save(session, step)
            _preempted(session, step, why)
            break
    session.saver.close()  # the last checkpoint is complete before the job goes on or ends
    session.notice.close()
    # what the saves cost the run, without the start and the export (tools/bench/checkpoint_save.py)
    _log.info(f"the training loop ran steps {session.start + 1}-{done} in {time.perf_counter() - began:.2f} s, "
              "its checkpoints included")
    shown.close()
    if session.board is not None:
        session.board.close()
    return done


def _preempted(session: Session, step: int, why: str) -> None:
    session.saver.wait()
    with every_rank_or_none(f"note the preemption after step {step}", session.device):
        if session.rank0:
            preemption.mark(session.job.output_dir, step, why, session.run_id)
    _log.warning(f"preempted ({why}): every rank stopped after step {step}, whose checkpoint is complete")


def _finish(session: Session) -> None:
    """The end of the whole job: the model in transformers' layout, and the loss plot."""
    output = Path(session.job.output_dir)
    save_pretrained(session.model, output / "final")  # a PEFT model: its adapter, in PEFT's format
    if session.job.peft is not None and session.job.peft.export_merged:
        save_pretrained(session.model, output / "final_merged", merge_adapters=True)
    if session.job.logging.plot:
        with every_rank_or_none("plot the loss", session.device):
            if session.rank0:
                plot_loss(output)


# ----- the whole run ---------------------------------------------------------------------------


def _run(job: JobConfig, resume: str, stop_at_step: int | None, sizes: JobSizes,
         hooks: fault_injection.Hooks, notice: preemption.WorkerNotice) -> dict:
    session = _setup(job, resume, sizes, hooks, notice)
    last = min(job.run.steps, stop_at_step) if stop_at_step is not None else job.run.steps
    done = _loop(session, last)
    if done == job.run.steps:
        _finish(session)
    return {"last_step": done, "resumed_from": session.start, "run": session.run_id}


def train(job: JobConfig, resume: str = "auto", stop_at_step: int | None = None) -> dict:
    """Train ``job`` from its latest checkpoint (``resume``). ``stop_at_step`` ends the run
    cleanly after that step, with a checkpoint, as at the end of a time-limited allocation;
    the learning-rate schedule still spans ``run.steps``."""
    # Checked before any process group: the sizes and the accumulation at this world, and the
    # fault-injection variable (tests only; see cli.faults).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = job_sizes(job, world)
    hooks = fault_injection.hooks()
    notice = preemption.WorkerNotice(job.run.preemption_signals)  # first: a notice may come at any time
    watch = _start_group(job, world)
    try:
        result = _run(job, resume, stop_at_step, sizes, hooks, notice)
    except BaseException as error:
        if watch is not None:
            watch.post(error)
        raise
    _end_group(watch)
    return result


def _rank(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description="one rank of fsdp-turbo train")
    parser.add_argument("config", help="the job file (its resolved form comes from fsdp-turbo train)")
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--stop-at-step", type=int)
    args = parser.parse_args(argv)
    job = load_job(args.config)
    # DTensor's note that a 2-D (efsdp x ep) gradient norm takes two all-reduces, every step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    train(job, args.resume, args.stop_at_step)


def rank_main(argv: list[str]) -> None:
    """One rank as ``fsdp-turbo train`` starts it: a function torchrun's agent runs in a
    process forked from the launcher's forkserver (``cli.main.run_agent``). It returns (the
    agent collects every rank's return); multiprocessing then ends the process without
    finalizing the interpreter, which ``end_process`` does for ``main``."""
    try:
        _rank(argv)
    except Exception:
        # The agent reports the first worker it finds ended, and only that one. A rank whose
        # peer was killed (the OOM killer, SIGKILL) fails at once on the broken connection:
        # waiting a moment lets the agent find the killed rank first, the root cause; a rank
        # that raises waits as long, so the first to fail is still found first. Every rank's
        # own error goes to the log, as a worker process printed it.
        _log.exception("this rank failed")
        time.sleep(_REPORT_GRACE_S)
        raise
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """``python -m fsdp_turbo.cli.worker``: one rank under a plain torchrun."""
    _rank(argv)
    end_process(0)


if __name__ == "__main__":
    main()
