"""fsdp-turbo: the meta-package that installs every FSDPTurbo package, and the ``fsdp-turbo``
command (``main``): ``train`` through torchrun, and ``plan``, a dry run."""

__version__ = "0.1.0"
