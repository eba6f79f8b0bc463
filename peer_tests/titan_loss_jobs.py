"""torchtitan's Llama 3 with the loss computed by FSDPTurbo's ``lm_loss``: the call a loop
makes for a model that returns logits, so context parallel, loss parallel and chunked loss
can change what the logits are (a sequence chunk, a vocab shard, never built) while the
loss stays the full batch's mean."""

from __future__ import annotations

import torch
from titan_jobs import batches, titan_llama
from torch.distributed.tensor import DTensor

from fsdp_turbo.core.testing import shard_rows, train_steps


def aligned_labels(batch: torch.Tensor) -> torch.Tensor:
    """torchtitan's convention: ``labels[:, t]`` is the target of position ``t``."""
    return torch.nn.functional.pad(batch[:, 1:], (0, 1), value=-100)


def lm_loss_of(model, batch):
    from fsdp_turbo.fsdp_turbo import lm_loss

    return lm_loss(model, aligned_labels(batch), batch)


def turbo_lm_loss_run(config: dict):
    """The record, and the widths of the logits the head returned (0: chunked loss ran)."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, titan_llama())
    widths = []
    # the logits this rank holds (a vocab shard under loss parallel)
    model.output.register_forward_hook(lambda module, args, out: widths.append(
        (out.to_local() if isinstance(out, DTensor) else out).shape[-1]))
    state = model.parallel_state
    mine = [shard_rows(b, state.dp_rank, state.dp_size) for b in batches()]
    return train_steps(model, mine, loss_fn=lm_loss_of), widths
