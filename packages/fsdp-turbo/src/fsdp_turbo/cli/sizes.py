"""A job's sizes at a world size, from one place: the launcher's check before torchrun, each
worker's before its process group, and ``fsdp-turbo plan`` all call ``job_sizes``.

The parallel sizes are the library's own resolution (``FSDPTurboConfig.validate``, i.e.
``core.parallel_state.resolve_parallel_sizes``); the accumulation is ``RunSection``'s, over
the data shards those sizes give. Nothing else in the command multiplies parallel sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import ParallelSizes
from fsdp_turbo.fsdp_turbo_config import PIPELINE_STAGES_PER_RANK


@dataclass(frozen=True)
class JobSizes:
    """What a job resolves to at one world size."""

    parallel: ParallelSizes
    accumulation: int  # micro-batches per optimizer step on each data shard
    micro_batch: int

    @property
    def data_shards(self) -> int:
        return self.parallel.dp_replicate_x_fsdp

    @property
    def rows_per_step(self) -> int:
        """Sequences per optimizer step over all data shards (the global batch)."""
        return self.micro_batch * self.data_shards * self.accumulation


def job_sizes(job: JobConfig, world_size: int) -> JobSizes:
    """The job's parallel sizes and gradient accumulation at ``world_size``; a ``ConfigError``
    names the field when the sizes do not tile that world or the global batch does not split."""
    parallel = job.turbo.validate(world_size)
    sizes = JobSizes(parallel, job.run.accumulation(parallel.dp_replicate_x_fsdp), job.run.micro_batch)
    if parallel.pp > 1:
        _check_pipeline_rows(job, sizes)
    return sizes


def _check_pipeline_rows(job: JobConfig, sizes: JobSizes) -> None:
    """A pipeline runs each step's micro-batches (``micro_batch x accumulation`` rows a data
    shard) as one batch, split into ``pipeline_microbatches``; an evaluation, each eval
    micro-batch (``micro_batch`` rows) alike. Both must split evenly."""
    turbo = job.turbo
    per_rank = turbo.pipeline_stages_per_rank or PIPELINE_STAGES_PER_RANK[turbo.pipeline_schedule]
    split = turbo.pipeline_microbatches or sizes.parallel.pp * per_rank
    rows = sizes.micro_batch * sizes.accumulation
    if rows % split:
        raise ConfigError("turbo.pipeline_microbatches", split, f"use a divisor of the {rows} rows each data shard "
                          f"trains a step (run.micro_batch {sizes.micro_batch} x {sizes.accumulation} "
                          "accumulated), or change those",
                          reason="the pipeline splits each step's rows into equal micro-batches")
    if job.data.eval is not None and sizes.micro_batch % split:
        raise ConfigError("turbo.pipeline_microbatches", split, f"use a divisor of run.micro_batch "
                          f"({sizes.micro_batch}), which each evaluation batch holds, or drop data.eval",
                          reason="the pipeline splits each evaluation batch into equal micro-batches")


def default_world_size(job: JobConfig) -> int:
    """The world the job's sizes describe by themselves: their product, where
    ``fully_shard_parallel_size: -1`` (inferred from the world) counts as 1."""
    turbo = job.turbo
    fsdp = turbo.fully_shard_parallel_size if turbo.fully_shard_parallel_size != -1 else 1
    return math.prod((turbo.data_parallel_size, fsdp, turbo.context_parallel_size, turbo.tensor_parallel_size,
                      turbo.pipeline_parallel_size))
