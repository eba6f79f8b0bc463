"""FSDP2 (``fully_shard``) on the modules the plan picks, then the root."""

from fsdp_turbo.distributed.fully_shard_parallel.transform import FSDPPlan, FullyShardTransform, plan_fully_shard
from fsdp_turbo.distributed.fully_shard_parallel.units import ShardingUnits, select_units

__all__ = ["FSDPPlan", "FullyShardTransform", "ShardingUnits", "plan_fully_shard", "select_units"]
