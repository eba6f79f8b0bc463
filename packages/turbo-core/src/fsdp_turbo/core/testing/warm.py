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
from fsdp_turbo.core.plugin import ENTRY_POINT_GROUP

# The transforms of the installed feature packages (a package session has only its own).
for _point in entry_points(group=ENTRY_POINT_GROUP):
    _point.load()

# transformers builds its table of checkpoint conversions (every model type's, each with its
# regexes compiled) on a process's first save or load of a model: 0.3 s of CPU in every rank
# that saves or loads. Built here, the ranks inherit it.
try:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
except ImportError:  # no transformers in this session, or transformers 4 (no conversions)
    pass
else:
    get_checkpoint_conversion_mapping("llama")
