"""The training step's loss normalisation and the held-out evaluation.

Training loss is the mean over every token that carries loss in the step's global batch
(all data shards, all gradient-accumulation micro-batches), as if the batch were one: each
micro-batch's loss is its sum over ``num_items_in_batch``, the world mean of the step's
loss-token counts. Data-parallel gradients are averaged over the data shards, which turns
the shards' sums into the global mean. So SFT batches with few assistant tokens weigh as
little as they should, and no shard's batch counts more than its tokens.

Evaluation is token-weighted the same way: the sum of each micro-batch's mean loss times its
loss tokens, over the eval batches and data shards, divided by their loss tokens (a
micro-batch with no loss tokens, e.g. SFT rows with no assistant turn, adds nothing). With
packing that is exactly the mean over the held-out documents run one at a time.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fsdp_turbo.cli.data import Batch, EvalSet
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.stage_part import stage_parts


def _world_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def items_per_rank(batches: list[Batch], device: torch.device) -> torch.Tensor:
    """``num_items_in_batch`` for this step: the world mean of its loss-token counts (every
    rank of a data shard holds the same batch, so the mean is the global count over dp)."""
    (total,) = _world_sum([float(sum(b.loss_tokens() for b in batches))], device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return torch.tensor(max(total / world, 1.0), device=device)


def _require_loss_tokens(tokens: float, batches: int) -> None:
    if not tokens:  # the same on every rank (a world sum): a loss of 0 here would be a number that misleads
        raise ConfigError("data.eval.batches", batches, "add held-out data that carries loss (for SFT: assistant "
                          "turns) or evaluate more batches", reason="the eval batches hold no loss tokens on any "
                          "data shard")


def check_eval_set(held_out: EvalSet, micro_batch: int, batches: int, dp_rank: int, dp_size: int,
                   device: torch.device) -> None:
    """Before step 1, what ``evaluate`` would find at its first call: a set too small for
    ``batches`` (on this rank), or no loss token in them (on any rank: a collective)."""
    with every_rank_or_none("check the eval set", device):
        count = sum(b.loss_tokens() for b in held_out.batches(micro_batch, dp_rank, dp_size, batches))
    (tokens,) = _world_sum([float(count)], device)
    _require_loss_tokens(tokens, batches)


def pipeline_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """A batch as a pipeline's ``step`` and ``evaluate`` take it."""
    return {name: value for name, value in batch.model_inputs().items() if isinstance(value, torch.Tensor)}


def forward_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The batch's mean loss, forward only: the model's own, or its pipeline's."""
    runner = getattr(model, "fsdp_turbo_pipeline", None)
    if runner is not None:
        return runner.evaluate(**pipeline_inputs(batch))
    return model(**batch.model_inputs()).loss


@torch.no_grad()
def evaluate(model: torch.nn.Module, held_out: EvalSet, micro_batch: int, batches: int, dp_rank: int, dp_size: int,
             device: torch.device) -> dict[str, float]:
    """``eval_loss`` and ``eval_perplexity`` over the first ``batches`` eval micro-batches."""
    parts = stage_parts(model)
    was_training = model.training
    for part in parts:
        part.eval()
    weighted, tokens = 0.0, 0.0
    try:
        for batch in held_out.batches(micro_batch, dp_rank, dp_size, batches):
            count = batch.loss_tokens()
            # Every micro-batch runs its forward, loss tokens or not: the ranks of a shard run
            # their collectives together. One with none has loss NaN (a mean over nothing), and
            # NaN x 0 is NaN, so it adds nothing rather than its product.
            loss = forward_loss(model, batch.to(device))
            if count:
                weighted += float(loss.float()) * count
                tokens += count
    finally:
        for part in parts:
            part.train(was_training)
    weighted, tokens = _world_sum([weighted, tokens], device)
    _require_loss_tokens(tokens, batches)
    loss = weighted / tokens
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 80.0))}
