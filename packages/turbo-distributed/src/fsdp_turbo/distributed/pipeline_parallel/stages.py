"""Which decoder layers each pipeline stage holds, and which stages each rank runs (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

from fsdp_turbo.core.errors import ConfigError


@dataclass(frozen=True)
class StageSpec:
    index: int
    rank: int  # the coordinate on the pp mesh dim that runs it
    first: int  # its first decoder layer
    stop: int  # one past its last

    def layers(self) -> range:
        return range(self.first, self.stop)


def layer_bounds(layers: int, stages: int, split_points: tuple[int, ...]) -> list[tuple[int, int]]:
    """``[first, stop)`` of each stage: the declared split points, else an even split."""
    if split_points:
        if len(split_points) != stages - 1:
            raise ConfigError("pipeline_split_points", list(split_points),
                              f"give {stages - 1} split points for {stages} stages",
                              reason=f"there are {stages} stages")
        if split_points[-1] >= layers:
            raise ConfigError("pipeline_split_points", list(split_points),
                              f"keep every split point below the number of layers {layers}",
                              reason="a stage would hold no layer")
        starts = (0, *split_points)
        return list(zip(starts, (*split_points, layers), strict=True))
    if layers % stages:
        raise ConfigError("pipeline_parallel_size x pipeline_stages_per_rank", stages,
                          f"make the {layers} decoder layers divide by the stages, or declare pipeline_split_points",
                          reason=f"{layers} layers do not split evenly into {stages} stages")
    per = layers // stages
    return [(i * per, (i + 1) * per) for i in range(stages)]


def plan_stages(layers: int, pp: int, per_rank: int, style: str,
                split_points: tuple[int, ...]) -> tuple[StageSpec, ...]:
    stages = pp * per_rank
    to_rank = generate_stage_to_rank_mapping(pp, stages, style=style)
    return tuple(StageSpec(index, to_rank[index], first, stop)
                 for index, (first, stop) in enumerate(layer_bounds(layers, stages, split_points)))
