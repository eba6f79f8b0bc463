"""A training job launched by the real torchrun from the integration tests.

The facade initialises the process group from torchrun's environment by itself.
Rank 0 saves the parity record (losses and first-step gradients) to --out.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from fsdp_turbo.core.device import end_process
from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo

BATCH_SPEC = {"vocab_size": 256, "global_batch": 8, "seq_len": 16, "steps": 4}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", default="llama")
    parser.add_argument("--config", required=True, help="FSDPTurboConfig as JSON")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = FSDPTurbo(json.loads(args.config), tiny_hf_causal_lm(args.kind))
    state = model.parallel_state
    assert dist.is_initialized(), "the facade should have initialised the process group"
    batches = [shard_rows(b, state.dp_rank, state.dp_size) for b in make_token_batches(**BATCH_SPEC)]
    record = train_steps(model, batches)
    if state.rank == 0:
        torch.save({"losses": record.losses, "grads": record.grads, "world": dist.get_world_size()}, args.out)
    end_process(0)  # destroy the group and skip the interpreter's teardown (see its docstring)


if __name__ == "__main__":
    main()
