"""Train a few steps and compare against a reference: losses each step, first-step gradients."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class TrainRecord:
    """Per-step losses (averaged over data shards) and the first step's full gradients."""

    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def make_token_batches(*, vocab_size: int, global_batch: int, seq_len: int, steps: int,
                       seed: int = 1234) -> list[torch.Tensor]:
    """``steps`` global batches of token ids, identical in every process for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (global_batch, seq_len), generator=generator) for _ in range(steps)]


def shard_rows(batch: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This data shard's rows of a global batch; the batch must divide evenly."""
    if batch.shape[0] % size:
        raise ValueError(f"global batch {batch.shape[0]} does not divide into {size} data shards")
    rows = batch.shape[0] // size
    return batch[rank * rows : (rank + 1) * rows]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, float32, CPU copy of the whole tensor, gathering a DTensor if needed."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", torch.float32).clone()


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``value`` against ``reference``, in dB."""
    reference, value = reference.double(), value.double()
    noise = (reference - value).pow(2).sum().clamp_min(1e-300)
    return float(10 * torch.log10(reference.pow(2).sum().clamp_min(1e-300) / noise))


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The HF causal-LM loss with labels = inputs (HF shifts them)."""
    return model(input_ids=input_ids, labels=input_ids).loss


def _world_mean(value: torch.Tensor) -> float:
    value = value.detach().to(torch.float64).reshape(1).clone()
    if dist.is_available() and dist.is_initialized():
        # gloo has no AVG reduction; every rank of a data shard holds the same loss.
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def train_steps(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    lr: float = 1e-2,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = causal_lm_loss,
    optimizer_factory: Callable[..., torch.optim.Optimizer] | None = None,
    record_grads: bool = True,
    clip_grad_norm: float | None = None,
) -> TrainRecord:
    """Train on ``batches`` (already this rank's shard) with AdamW; record losses and step-0 grads.

    The loss is averaged over all ranks, which equals the global-batch loss when
    every data shard holds the same number of tokens. With ``clip_grad_norm`` the
    gradients are clipped with ``torch.nn.utils.clip_grad_norm_`` after the step-0
    gradients are recorded, and each step's total norm is recorded.
    """
    params = list(model.parameters())
    device = params[0].device
    optimizer = (optimizer_factory or (lambda p: torch.optim.AdamW(p, lr=lr, foreach=False)))(params)
    record = TrainRecord()
    for step, batch in enumerate(batches):
        loss = loss_fn(model, batch.to(device))
        loss.backward()
        record.losses.append(_world_mean(loss))
        if step == 0 and record_grads:
            record.grads = {name: full_tensor(p.grad) for name, p in model.named_parameters() if p.grad is not None}
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            record.grad_norms.append(float(full_tensor(norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


def assert_parity(reference: TrainRecord, candidate: TrainRecord, *, loss_rtol: float = 1e-5,
                  loss_atol: float = 0.0, grad_rtol: float = 1e-4, grad_atol: float = 1e-6) -> None:
    """Assert each step's loss and every first-step gradient match, naming the first mismatch."""
    assert len(reference.losses) == len(candidate.losses), (reference.losses, candidate.losses)
    torch.testing.assert_close(
        torch.tensor(candidate.losses, dtype=torch.float64), torch.tensor(reference.losses, dtype=torch.float64),
        rtol=loss_rtol, atol=loss_atol, msg=lambda m: f"losses differ: {candidate.losses} vs {reference.losses}\n{m}")
    norms = [torch.tensor(r.grad_norms, dtype=torch.float64) for r in (candidate, reference)]
    torch.testing.assert_close(*norms, rtol=grad_rtol, atol=grad_atol, msg=lambda m: f"gradient norms differ\n{m}")
    assert set(candidate.grads) == set(reference.grads), (
        f"gradient names differ: {sorted(set(candidate.grads) ^ set(reference.grads))}")
    for name, expected in reference.grads.items():
        torch.testing.assert_close(candidate.grads[name], expected, rtol=grad_rtol, atol=grad_atol,
                                   msg=lambda m, n=name: f"gradient of {n} differs\n{m}")
