"""Where autograd is: the one question several features ask of the engine."""

from __future__ import annotations

import torch


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread. A forward that runs
    inside it is a recompute (activation checkpointing re-running a region), and must do as
    its original forward did: route the same way, keep its own hooks; FSDP's pre-backward
    all-gathers run inside it too."""
    return torch._C._current_graph_task_id() != -1
