"""Rank functions for the fsdp-turbo command's tests."""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.model import build_model, fill_weights
from fsdp_turbo.cli.optim import build_optimizer


def measured_model_state(job_dict: dict) -> int:
    """Per-rank bytes of parameters, gradients and optimizer states after one real step."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    job = JobConfig.from_dict(job_dict)
    model = FSDPTurbo(job.turbo, build_model(job.model))
    fill_weights(model, job.model, job.run.seed)
    optimizer = build_optimizer(model.parameters(), job.optimizer)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        state = model.parallel_state
        ids = torch.randint(0, 256, (job.run.micro_batch, job.data.seq_len),
                            generator=torch.Generator().manual_seed(state.dp_rank))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        snapshot = {str(k): v for k, v in tracker.get_tracker_snapshot("current")[torch.device("cpu")].items()}
    return sum(snapshot.get(f"_MemRefType.{kind}", 0) for kind in ("PARAM", "GRAD", "OPT"))
