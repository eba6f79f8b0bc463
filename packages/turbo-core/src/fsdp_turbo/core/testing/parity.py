"""Train a few steps and compare against a reference: losses each step, first-step gradients.

Quantized training needs one more tool. FP8 rounding is discontinuous: a last-bit difference
in a weight (another reduction order, another CPU's kernels) moves an element that sits on a
rounding boundary by a whole FP8 step, and AdamW then spreads that. Two runs that agree at
step 0 can therefore drift apart by more than float32 tolerances, and by how much depends on
the machine. :func:`replay_steps` removes the drift instead of loosening the tolerance: the
reference starts every step from the candidate's own weights (recorded with
``train_steps(..., record_params=True)``), so each step quantizes the same weights into the
same blocks, as the first step does, and :func:`assert_stepwise_parity` holds every step to
the float32 tolerances. By induction the candidate's whole trajectory is one the reference
takes: step k's update from the same weights and (matching) gradients lands on step k+1's
weights.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
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
    # With record_params: the full weights before each step and after the last (steps + 1
    # entries), and every step's full gradients.
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    step_grads: list[dict[str, torch.Tensor]] = field(default_factory=list)


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


def full_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`full_tensor` of each, DTensors alike gathered together: those of one shape, mesh,
    placements and dtype (a model's layers' copies of one weight) are stacked and gathered
    as one, so a record costs a collective per kind of tensor rather than per tensor (one
    each cost a 2-rank launch of the new families a fifth of its CPU time: 6066 gathers).
    The result is the same bits: a gather only copies."""
    from torch.distributed.tensor import DTensor

    alike: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor) and _stacked(tensor.placements) is not None:
            key = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride(), tensor.dtype)
            alike.setdefault(key, []).append(name)
    whole = {}
    for (mesh, placements, shape, stride, _), names in alike.items():
        if len(names) == 1:
            continue
        local = torch.stack([tensors[name].to_local().detach() for name in names])
        stacked = DTensor.from_local(local, mesh, _stacked(placements), run_check=False,
                                     shape=torch.Size((len(names), *shape)), stride=(shape.numel(), *stride))
        whole.update(zip(names, full_tensor(stacked).unbind(0), strict=True))
    return {name: whole[name].clone() if name in whole else full_tensor(tensor) for name, tensor in tensors.items()}


def _stacked(placements: tuple) -> tuple | None:
    """The placements of a stack of DTensors along a new first dimension (each sharded
    dimension one further), or None for a placement this does not know."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    moved = []
    for placement in placements:
        if type(placement) is Shard:
            moved.append(Shard(placement.dim + 1))
        elif type(placement) is _StridedShard:
            moved.append(_StridedShard(placement.dim + 1, split_factor=placement.split_factor))
        elif isinstance(placement, (Replicate, Partial)):
            moved.append(placement)
        else:
            return None
    return tuple(moved)


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
    record_params: bool = False,
) -> TrainRecord:
    """Train on ``batches`` (already this rank's shard) with AdamW; record losses and step-0 grads.

    The loss is averaged over all ranks, which equals the global-batch loss when
    every data shard holds the same number of tokens. With ``clip_grad_norm`` the
    gradients are clipped with ``torch.nn.utils.clip_grad_norm_`` after the step-0
    gradients are recorded, and each step's total norm is recorded. With ``record_params``
    the full weights before each step and after the last, and every step's gradients, are
    recorded for :func:`replay_steps`.
    """
    params = list(model.parameters())
    device = params[0].device
    optimizer = (optimizer_factory or (lambda p: torch.optim.AdamW(p, lr=lr, foreach=False)))(params)
    record = TrainRecord()
    for step, batch in enumerate(batches):
        if record_params:
            record.params.append(_full_params(model))
        loss = loss_fn(model, batch.to(device))
        loss.backward()
        record.losses.append(_world_mean(loss))
        if (step == 0 and record_grads) or record_params:
            grads = full_tensors({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
            record.grads = record.grads or grads
            if record_params:
                record.step_grads.append(grads)
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            record.grad_norms.append(float(full_tensor(norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if record_params:
        record.params.append(_full_params(model))
    return record


def train_pipeline_steps(model: nn.Module, batches: Sequence[torch.Tensor], *, lr: float = 1e-2) -> TrainRecord:
    """``train_steps`` for a pipelined model (``pipeline_parallel_size > 1``): each batch (the
    global one; this rank's data shard is taken here) through ``model.fsdp_turbo_pipeline.step``,
    AdamW over every stage's parameters. The losses are averaged over data shards; the
    first step's gradients are this rank's stages', gathered whole."""
    runner, state = model.fsdp_turbo_pipeline, model.parallel_state
    optimizer = torch.optim.AdamW(list(runner.parameters()), lr=lr, foreach=False)
    record = TrainRecord()
    for step, batch in enumerate(batches):
        shard = shard_rows(batch, state.dp_rank, state.dp_size)
        record.losses.append(_world_mean(runner.step(shard, shard.clone())))  # every rank: its shard's loss
        if step == 0:
            record.grads = full_tensors({name: p.grad for part in runner.parts
                                         for name, p in part.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return full_tensors(dict(model.named_parameters()))


def replay_steps(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    params: Sequence[dict[str, torch.Tensor]],
    *,
    lr: float = 1e-2,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = causal_lm_loss,
) -> TrainRecord:
    """The one-process reference of a quantized run, replayed on the candidate's weights.

    Before step k the model's weights are set to ``params[k]`` (the candidate's, from
    ``train_steps(..., record_params=True)``); the step then runs as in :func:`train_steps`
    (AdamW, its state carried from step to step). The record holds each step's loss and
    gradients and, in ``params``, the weights each step produced (``params[k + 1]`` of a
    faithful candidate). The candidate must start from this model's own weights, exactly:
    replaying cannot hide a wrong start.
    """
    named = dict(model.named_parameters())
    if set(named) != set(params[0]):
        raise ValueError(f"parameter names differ from the candidate's: {sorted(set(named) ^ set(params[0]))}")
    for name, value in params[0].items():
        if not torch.equal(full_tensor(named[name]), value):
            raise AssertionError(f"the candidate's initial {name} differs from the reference model's")
    optimizer = torch.optim.AdamW(list(named.values()), lr=lr, foreach=False)
    record = TrainRecord()
    for step, batch in enumerate(batches):
        with torch.no_grad():
            for name, value in params[step].items():
                named[name].copy_(value)
        loss = loss_fn(model, batch)
        loss.backward()
        record.losses.append(float(loss))
        record.step_grads.append({name: full_tensor(p.grad) for name, p in named.items() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record.params.append(_full_params(model))
    record.grads = record.step_grads[0]
    return record


def assert_stepwise_parity(replayed: TrainRecord, candidate: TrainRecord, *, loss_rtol: float = 1e-5,
                           grad_rtol: float = 1e-4, grad_atol: float = 1e-6, update_rtol: float = 1e-4) -> None:
    """Every step of ``candidate`` against :func:`replay_steps` from the same weights.

    Each step's loss (``loss_rtol``) and gradients (``grad_rtol`` / ``grad_atol``), and the
    update it made: ``candidate.params[k + 1] - params[k]`` against the replay's, per tensor
    in relative L2 (``update_rtol``). Not per element: AdamW's first update is
    ``lr * g / (|g| + eps)``, whose slope ``lr * eps / (|g| + eps)**2`` reaches ``lr / eps``
    where a gradient is near zero, so an element whose gradients agree within ``grad_atol``
    may still move differently by up to ``2 * lr``; a few such elements leave the tensor's
    relative L2 far below ``update_rtol``, while a wrong update is off by order one.
    """
    steps = len(candidate.losses)
    assert len(replayed.losses) == steps and len(candidate.params) == steps + 1, "record every step's weights"
    for step in range(steps):
        torch.testing.assert_close(candidate.losses[step], replayed.losses[step], rtol=loss_rtol, atol=0,
                                   msg=lambda m, s=step: f"step {s}: losses differ from the same weights\n{m}")
        for name, expected in replayed.step_grads[step].items():
            torch.testing.assert_close(candidate.step_grads[step][name], expected, rtol=grad_rtol, atol=grad_atol,
                                       msg=lambda m, s=step, n=name: f"step {s}: gradient of {n} differs\n{m}")
        for name, after in replayed.params[step].items():
            start = candidate.params[step][name]
            expected, got = after - start, candidate.params[step + 1][name] - start
            error = float((got - expected).norm() / expected.norm().clamp_min(1e-30))
            assert error <= update_rtol, f"step {step}: the update of {name} differs by {error:.2e} (relative L2)"


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
