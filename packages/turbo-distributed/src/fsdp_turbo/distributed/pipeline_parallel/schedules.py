"""The pipeline schedules this library offers, as data: each is one of
``torch.distributed.pipelining``'s, with the stages a rank holds and where they go."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.fsdp_turbo_config import PIPELINE_STAGES_PER_RANK


@dataclass(frozen=True)
class ScheduleKind:
    torch_name: str  # torch.distributed.pipelining.schedules.get_schedule_class's name
    stages_per_rank: int  # the default
    style: str  # stage -> rank: "loop" (stage s on rank s % pp) or "v" (rank r: stages r and 2pp-1-r)
    fixed: bool  # the schedule takes exactly ``stages_per_rank`` stages a rank

    @property
    def multi(self) -> bool:
        """Several stages a rank: torch's ``PipelineScheduleMulti`` family, given a list."""
        return self.style == "v" or self.stages_per_rank > 1


_DEFAULT = PIPELINE_STAGES_PER_RANK
SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind("GPipe", _DEFAULT["gpipe"], "loop", fixed=True),
    "1f1b": ScheduleKind("1F1B", _DEFAULT["1f1b"], "loop", fixed=True),
    "interleaved_1f1b": ScheduleKind("Interleaved1F1B", _DEFAULT["interleaved_1f1b"], "loop", fixed=False),
    "zbv": ScheduleKind("ZBVZeroBubble", _DEFAULT["zbv"], "v", fixed=True),
    "dualpipev": ScheduleKind("DualPipeV", _DEFAULT["dualpipev"], "v", fixed=True),
}


def stages_per_rank(schedule: str, configured: int | None) -> int:
    kind = SCHEDULES[schedule]
    if configured is None:
        return kind.stages_per_rank
    if kind.fixed and configured != kind.stages_per_rank:
        raise ConfigError("pipeline_stages_per_rank", configured, f"use {kind.stages_per_rank} (or leave it unset)",
                          reason=f"pipeline_schedule {schedule!r} runs {kind.stages_per_rank} stage(s) a rank")
    if not kind.fixed and configured < 2:
        raise ConfigError("pipeline_stages_per_rank", configured, "use 2 or more, or pipeline_schedule '1f1b'",
                          reason=f"pipeline_schedule {schedule!r} interleaves several stages a rank")
    return configured


def check_microbatches(schedule: str, microbatches: int, stages: int, pp: int) -> None:
    """What torch's schedules require of the micro-batch count, checked before anything runs."""
    if schedule in ("1f1b", "dualpipev") and microbatches < stages:
        raise ConfigError("pipeline_microbatches", microbatches, f"use at least {stages}, the number of stages",
                          reason=f"pipeline_schedule {schedule!r} needs a micro-batch for every stage")
    if schedule in ("interleaved_1f1b", "zbv"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError("pipeline_microbatches", microbatches,
                              f"use a multiple of the pipeline size {pp}, or fewer than {2 * pp}",
                              reason=f"pipeline_schedule {schedule!r} runs the micro-batches in rounds of "
                                     f"{pp}")
