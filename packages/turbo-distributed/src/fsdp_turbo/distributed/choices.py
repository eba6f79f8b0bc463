"""The names turbo-distributed publishes for config fields (entry-point group ``fsdp_turbo.choices``,
see ``fsdp_turbo.core.choices``).

They live in a module of their own so that a config is checked without importing the transforms:
expert parallel's package imports ``torch.distributed.tensor`` and dynamo, about a second of CPU in
every process that only reads a job (the ``fsdp-turbo`` launcher, ``plan``). ``ep_plan.dispatcher``
names one of ``expert_parallel.dispatchers.DISPATCHERS``, which holds exactly these (a test checks).
"""

EP_DISPATCHERS: tuple[str, ...] = ("eager", "fused", "mc2", "domino")
