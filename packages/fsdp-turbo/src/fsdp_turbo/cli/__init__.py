"""fsdp-turbo: the meta-package that installs every FSDPTurbo package.

The ``fsdp-turbo`` command (train, plan, checkpoint, resume) lands here (issue 8).
"""

__version__ = "0.1.0"
