"""turbo-distributed: FSDPTurbo's parallelism transforms (FSDP2/HSDP so far)."""

__version__ = "0.1.0"
