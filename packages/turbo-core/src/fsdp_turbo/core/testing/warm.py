"""What every test rank imports, imported once: the forkserver's preload (``harness.PRELOAD``).

Ranks fork from a server that has imported torch, transformers' common model files and
every installed FSDPTurbo transform, so a test pays for none of these imports again (about
110 FSDPTurbo modules and the model files they pull in). Importing only loads modules: no
thread, process group or device is started here, so forking afterwards stays safe.
"""

from importlib.metadata import entry_points

import torch
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.tensor.parallel
import torch.utils.checkpoint  # noqa: F401

import fsdp_turbo.core.testing  # noqa: F401
from fsdp_turbo.core.hf import build_conversion_table
from fsdp_turbo.core.plugin import ENTRY_POINT_GROUP

# The transforms of the installed feature packages (a package session has only its own).
for _point in entry_points(group=ENTRY_POINT_GROUP):
    _point.load()

# transformers' checkpoint-conversion table, built here once instead of in every rank that saves
# or loads (core.hf imports transformers lazily: a session without it builds nothing)
try:
    import transformers  # noqa: F401
except ImportError:  # no transformers in this session
    pass
else:
    build_conversion_table()
