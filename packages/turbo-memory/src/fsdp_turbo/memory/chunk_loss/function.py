"""Cross-entropy of ``hidden @ weight.T`` computed chunk by chunk: the [tokens, vocab]
logits never exist, only one [chunk, vocab] buffer that every chunk reuses.

The gradients are computed in the forward, chunk by chunk, while each chunk's logits
are at hand; backward only scales them. The loss head is the model's last op, so the
gradients live from the loss forward to the start of backward and cost nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_turbo.core.model_facts import IGNORE_INDEX


@dataclass(frozen=True)
class ChunkOptions:
    chunk_size: int = 1024
    ignore_index: int = IGNORE_INDEX
    z_loss_weight: float = 0.0
    logit_softcap: float | None = None
    # Vocab parallel: this rank holds rows [vocab_start, vocab_start + weight.shape[0]).
    vocab_group: dist.ProcessGroup | None = None
    vocab_start: int = 0
    # The backward may run twice: a zero-bubble pipeline's split backward runs it for the
    # input gradients, then again for the weight gradients. Its gradients are then kept
    # whole until the graph goes, not scaled in place and freed at once.
    backward_twice: bool = False


def _vocab_all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


class _ChunkBuffers:
    """The per-call scratch space: one fp32 logits chunk, plus low-precision twins when needed."""

    def __init__(self, rows: int, hidden: torch.Tensor, weight: torch.Tensor, options: ChunkOptions,
                 with_grads: bool) -> None:
        vocab = weight.shape[0]
        self.logits = torch.empty(rows, vocab, dtype=torch.float32, device=hidden.device)
        low_precision = hidden.dtype != torch.float32
        self.matmul = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device) if low_precision else None
        self.tanh = (torch.empty_like(self.logits) if options.logit_softcap is not None and with_grads else None)
        self.weight_grad_part = torch.empty_like(weight) if (with_grads and low_precision) else None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  buffers: _ChunkBuffers, rows: int, cap: float | None) -> torch.Tensor:
    logits = buffers.logits[:rows]
    if buffers.matmul is None:
        torch.mm(h, weight.t(), out=logits)
    else:
        logits.copy_(torch.mm(h, weight.t(), out=buffers.matmul[:rows]))
    if bias is not None:
        logits.add_(bias.float())
    if cap is not None:
        logits.div_(cap).tanh_()
        if buffers.tanh is not None:
            buffers.tanh[:rows].copy_(logits)
        logits.mul_(cap)
    return logits


def _forward_and_grads(hidden, weight, bias, labels, divisor, options: ChunkOptions, with_grads: bool):
    tokens = hidden.shape[0]
    vocab_local = weight.shape[0]
    chunk = min(options.chunk_size, max(tokens, 1))
    buffers = _ChunkBuffers(chunk, hidden, weight, options, with_grads)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
    grad_bias = torch.zeros_like(bias, dtype=torch.float32) if (with_grads and bias is not None) else None
    z_weight = options.z_loss_weight
    for start in range(0, tokens, chunk):
        rows = min(chunk, tokens - start)
        h = hidden[start:start + rows]
        target = labels[start:start + rows]
        valid = target != options.ignore_index
        local_target = target - options.vocab_start
        mine = valid & (local_target >= 0) & (local_target < vocab_local)
        index = torch.where(mine, local_target, 0).unsqueeze(1)

        logits = _chunk_logits(h, weight, bias, buffers, rows, options.logit_softcap)
        row_max = logits.amax(dim=1)
        _vocab_all_reduce(row_max, dist.ReduceOp.MAX, options.vocab_group)
        target_logit = torch.where(mine, logits.gather(1, index).squeeze(1), 0.0)
        logits.sub_(row_max.unsqueeze(1)).exp_()
        sums = torch.stack((logits.sum(dim=1), target_logit))
        _vocab_all_reduce(sums, dist.ReduceOp.SUM, options.vocab_group)
        sum_exp, target_logit = sums[0], sums[1]
        lse = row_max + sum_exp.log()
        row_loss = lse - target_logit
        if z_weight:
            row_loss = row_loss + z_weight * lse.square()
        total += torch.where(valid, row_loss, 0.0).sum()
        if not with_grads:
            continue

        # d loss / d logits = softmax * (1 + 2 z lse) - onehot(target), per valid row / divisor.
        row_scale = valid.float() / divisor
        # One pass: normalise the exponentials and scale the row, together.
        scale = row_scale / sum_exp
        probs = logits.mul_((scale * (1.0 + 2.0 * z_weight * lse)).unsqueeze(1) if z_weight else scale.unsqueeze(1))
        probs.scatter_add_(1, index, -torch.where(mine, row_scale, 0.0).unsqueeze(1))
        if buffers.tanh is not None:
            tanh = buffers.tanh[:rows]
            probs.mul_(1.0 - tanh.square_())
        grad = probs if buffers.matmul is None else buffers.matmul[:rows].copy_(probs)
        torch.mm(grad, weight, out=grad_hidden[start:start + rows])
        if buffers.weight_grad_part is None:
            grad_weight.addmm_(grad.t(), h)
        else:
            grad_weight.add_(torch.mm(grad.t(), h, out=buffers.weight_grad_part))
        if grad_bias is not None:
            grad_bias.add_(probs.sum(dim=0))
    return total / divisor, grad_hidden, grad_weight, grad_bias


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, divisor, options: ChunkOptions, with_grads: bool):
        with torch.no_grad():
            loss, grad_hidden, grad_weight, grad_bias = _forward_and_grads(
                hidden, weight, bias, labels, divisor, options, with_grads)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.backward_twice = options.backward_twice
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads, dtypes = ctx.grads, ctx.dtypes
        if not ctx.backward_twice:
            del ctx.grads
        scaled = []
        for grad, dtype, needed in zip(grads, dtypes, ctx.needs_input_grad[:3], strict=True):
            if grad is None or not needed:
                scaled.append(None)
                continue
            in_place = grad.dtype == torch.float32 and not ctx.backward_twice
            grad = grad.mul_(grad_loss) if in_place else grad.mul(grad_loss)
            scaled.append(grad.to(dtype))
        return (*scaled, None, None, None, None)


def _divisor(labels: torch.Tensor, ignore_index: int, reduction: str,
             num_items: int | float | torch.Tensor | None) -> torch.Tensor:
    if num_items is not None:
        return torch.as_tensor(num_items, dtype=torch.float32, device=labels.device)
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=labels.device)
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    # The mean over every valid token of the call, not per chunk; no valid token gives 0, not NaN.
    return (labels != ignore_index).sum().clamp_min(1).to(torch.float32)


# Device types where torch's chunked linear_cross_entropy beat ours in tools/bench/chunk_loss.py.
# On CPU ours is faster: time vs naive 0.859 for ours, 1.237 for torch's (tools/bench/RESULTS.md,
# CPU run of 2026-11-30), so the table is empty until the GPU check measures CUDA.
_TORCH_FASTER_ON: frozenset[str] = frozenset()


def _torch_has_linear_cross_entropy() -> bool:
    return hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def _use_torch(backend: str, device_type: str, **features) -> bool:
    if backend not in ("auto", "turbo", "torch"):
        raise ValueError(f"backend must be 'auto', 'turbo' or 'torch', not {backend!r}")
    plain = not features["z_loss_weight"] and features["logit_softcap"] is None and features["vocab_group"] is None
    if backend == "torch":
        if not _torch_has_linear_cross_entropy():
            raise ValueError("backend='torch' needs torch.nn.functional.linear_cross_entropy (torch >= 2.13)")
        if not plain:
            raise ValueError("backend='torch' supports no z-loss, soft-capping or vocab parallel")
        return True
    return backend == "auto" and plain and device_type in _TORCH_FASTER_ON and _torch_has_linear_cross_entropy()


def _torch_linear_cross_entropy(hidden, weight, labels, bias, ignore_index, reduction, num_items, chunk_size):
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size)
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).to(hidden.device)
    total = torch.nn.functional.linear_cross_entropy(flat_hidden, weight, flat_labels, linear_bias=bias,
                                                     reduction="sum", ignore_index=ignore_index, options=options)
    return total.float() / _divisor(flat_labels, ignore_index, reduction, num_items)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
    num_items: int | float | torch.Tensor | None = None,
    z_loss_weight: float = 0.0,
    logit_softcap: float | None = None,
    vocab_group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    backend: str = "auto",
    backward_twice: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T + bias, labels)`` without the full logits.

    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]``; ``labels``: ``hidden.shape[:-1]``,
    already aligned (no shift). Softmax and sums are fp32 whatever the input dtype.
    ``reduction='mean'`` divides by the number of labels that are not ``ignore_index``
    (0 when there are none, not NaN); ``num_items`` overrides the divisor (HF's
    ``num_items_in_batch`` for gradient accumulation). ``z_loss_weight`` adds
    ``z * logsumexp**2`` per token; ``logit_softcap`` applies ``c * tanh(logits / c)``.
    With ``vocab_group``, ``weight`` holds rows ``[vocab_start, vocab_start + V_local)`` of
    a vocab sharded over that group; the loss is the full-vocab loss on every rank and the
    gradient of ``hidden`` is this rank's partial sum (sum it over the group).
    ``backend``: ``'turbo'`` (this implementation), ``'torch'`` (torch's
    ``F.linear_cross_entropy``, torch >= 2.13, plain features only) or ``'auto'``, which
    takes torch's only where it is present and was measured faster (see ``_TORCH_FASTER_ON``).
    ``backward_twice``: the backward may run again on the same graph (a zero-bubble pipeline's
    weight pass); this implementation then keeps its gradients until the graph goes.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, not {chunk_size}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} without its last dim")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}]")
    if _use_torch(backend, hidden.device.type, bias=bias, z_loss_weight=z_loss_weight,
                  logit_softcap=logit_softcap, vocab_group=vocab_group):
        return _torch_linear_cross_entropy(hidden, weight, labels, bias, ignore_index, reduction, num_items,
                                           chunk_size)
    options = ChunkOptions(chunk_size, ignore_index, float(z_loss_weight), logit_softcap, vocab_group, vocab_start,
                           backward_twice)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(hidden.device)
    divisor = _divisor(flat_labels, ignore_index, reduction, num_items)
    # Inside Function.forward grad mode is always off: decide here whether to build gradients.
    with_grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (flat_hidden, weight, bias))
    return _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_labels, divisor, options, with_grads)
