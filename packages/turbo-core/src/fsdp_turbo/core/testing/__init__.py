"""Public test harness shared by every package and the integration tests.

* :func:`run_distributed` spawns N ranks on gloo, with a timeout, and re-raises the
  first failing rank's error.
* :func:`run_reference` runs the same kind of function in one fresh process with no
  process group: the single-process reference of a parity test.
* :mod:`.parity` trains a model for a few steps and compares losses and gradients.
* :mod:`.models` builds tiny Hugging Face models from a config (random init).
"""

from fsdp_turbo.core.testing.harness import RankFailure, device_under_test, run_distributed, run_reference
from fsdp_turbo.core.testing.parity import (
    TrainRecord,
    assert_parity,
    causal_lm_loss,
    full_tensor,
    full_tensors,
    make_token_batches,
    seed_everything,
    shard_rows,
    train_steps,
)

__all__ = [
    "RankFailure",
    "TrainRecord",
    "assert_parity",
    "causal_lm_loss",
    "full_tensor",
    "full_tensors",
    "make_token_batches",
    "run_distributed",
    "run_reference",
    "seed_everything",
    "shard_rows",
    "device_under_test",
    "train_steps",
]
