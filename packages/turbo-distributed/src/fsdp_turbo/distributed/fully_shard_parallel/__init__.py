"""FSDP2 (``fully_shard``) on the modules the plan picks, then the root."""

from fsdp_turbo.distributed.fully_shard_parallel.transform import FullyShardTransform
from fsdp_turbo.distributed.fully_shard_parallel.units import ShardingUnits, select_units

__all__ = ["FullyShardTransform", "ShardingUnits", "select_units"]
