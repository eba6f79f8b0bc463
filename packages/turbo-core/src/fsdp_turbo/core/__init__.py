"""turbo-core: the shared interface of FSDPTurbo (config, patterns, parallel state,
device layer, op registry, transform plugins, logging and the test harness)."""

from fsdp_turbo.core.errors import ConfigError

__version__ = "0.1.0"

__all__ = ["ConfigError", "__version__"]
