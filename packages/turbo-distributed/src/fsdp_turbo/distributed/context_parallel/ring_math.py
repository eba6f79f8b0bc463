"""The arithmetic of ring attention, as small pure functions (no communication).

A rank holds a query chunk and sees the key/value chunks one at a time. Each block gives
a partial output and the log-sum-exp of its scores; two partials merge exactly:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

so the blocks can arrive in any order. The backward needs only the final output and
log-sum-exp (FlashAttention's recomputation): per block, ``P = exp(S - lse)``,
``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O))``, ``dQ = dS K · scale``,
``dK = dSᵀ Q · scale``. Everything is in the inputs' dtype; fp32 is exact to rounding.

Masks are built from global token positions, so the same code serves contiguous chunks
and the zig-zag layout: key ``j`` is visible to query ``i`` when ``pos_k[j] <= pos_q[i]``
(and, for packed rows, when both are in the same document; for a sliding-window layer, when
``pos_q[i] - pos_k[j] < window``). A query row that sees no key in a block has
``lse = -inf`` there and contributes nothing.

Attention sinks (gpt-oss: one learned logit ``s_h`` per head, joined to every row's scores
with value 0) are one more partial: ``out = 0, lse = s_h``, merged once per row. The
backward kernels then see the final lse, which includes the sink, and the sink's own
gradient is ``-Σ exp(s_h - lse) · rowsum(dO ∘ O)`` (:func:`sink_grad`).

Shapes: queries ``[B, H, Sq, D]``, keys and values ``[B, H, Sk, D]`` (K/V heads already
repeated to H), masks ``[B or 1, 1, Sq, Sk]`` (True = attend), lse ``[B, H, Sq]``.
"""

from __future__ import annotations

import torch


def zigzag_chunks(cp: int) -> list[tuple[int, int]]:
    """The two of ``2 cp`` equal chunks each rank holds: ``r`` and ``2 cp - 1 - r``. Under a
    causal mask every rank then has the same amount of work."""
    return [(rank, 2 * cp - 1 - rank) for rank in range(cp)]


def chunk_positions(seq_len: int, cp: int, rank: int, load_balance: bool) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens (``seq_len`` a multiple of ``2 cp``
    with load balancing, of ``cp`` without)."""
    if not load_balance:
        size = seq_len // cp
        return torch.arange(rank * size, (rank + 1) * size)
    size = seq_len // (2 * cp)
    first, second = zigzag_chunks(cp)[rank]
    return torch.cat([torch.arange(first * size, (first + 1) * size),
                      torch.arange(second * size, (second + 1) * size)])


def to_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` padded with zeros on its last dimension to ``width`` (MLA's narrower values beside
    its queries and keys); ``t`` itself where it is that wide already (``F.pad`` would copy it)."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def cut_to(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` cut to ``width`` on its last dimension (``to_width``'s way back); ``t`` itself where
    it is that wide: a slice, even a whole one, costs its backward a zero-filled copy of ``t``."""
    return t if t.shape[-1] == width else t[..., :width]


def visible(q_positions: torch.Tensor, k_positions: torch.Tensor,
            q_documents: torch.Tensor | None = None, k_documents: torch.Tensor | None = None,
            window: int | None = None) -> torch.Tensor:
    """The causal (and per-document) mask ``[B or 1, 1, Sq, Sk]`` of one block; ``window``: a
    sliding-window layer's, where query ``q`` sees only keys ``q - window < k <= q``."""
    behind = q_positions[:, None] - k_positions[None, :]
    allowed = behind >= 0
    if window is not None:
        allowed = allowed & (behind < window)
    allowed = allowed[None, None]
    if q_documents is not None:
        allowed = allowed & (q_documents[:, None, :, None] == k_documents[:, None, None, :])
    return allowed


def sink_grad(sinks: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient of the per-head sink logits ``[H]`` from the final output and lse: the
    sink's probability in each row times ``-rowsum(dO ∘ O)``, summed over batch and rows."""
    delta = (grad_out * out).sum(-1)
    return -(torch.exp(sinks[None, :, None] - lse) * delta).sum((0, 2))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of the queries over one key/value block."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - _finite(lse)[..., None])
    return torch.matmul(weights, v), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row that sees nothing: -inf; its weights must come out 0, not NaN.
    return lse.masked_fill(torch.isinf(lse), 0.0)  # no zeros tensor: the merge runs once a tile


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries as one."""
    out, lse = out_a.clone(), lse_a.clone()
    merge_into(out, lse, out_b, lse_b)
    return out, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """``merge`` written into the running partials ``out`` and ``lse`` (views of a rank's whole
    output, one tile's rows): a block costs no new output-sized tensors and no copy back, which
    the ring pays once per tile."""
    merged = torch.logaddexp(lse, block_lse)
    base = _finite(merged)
    out.mul_(torch.exp(lse - base).nan_to_num_(0.0)[..., None])
    out.addcmul_(block_out, torch.exp(block_lse - base).nan_to_num_(0.0)[..., None])
    lse.copy_(merged)


def block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dQ, and its whole dK and dV, from the final output and lse."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - _finite(lse)[..., None])
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
    grad_probs = torch.matmul(grad_out, v.transpose(-1, -2))
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - delta)
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) * scale
    return grad_q, grad_k, grad_v
