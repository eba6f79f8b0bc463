r"""Portable (plain PyTorch) Kimi Delta Attention (KDA): the gated delta rule with one decay per
key channel instead of one per head, chunked for training and token by token for decoding.

The recurrence, per (sequence, value head), with state :math:`S \in \mathbb{R}^{K \times V}` and
``g_t`` a log-decay per key channel (``[K]``, every entry ``<= 0``)::

    S'_t = diag(e^{g_t}) S_{t-1}                      (each key channel's row decays on its own)
    S_t  = S'_t + k_t u_t^T,   u_t = beta_t (v_t - S'_t^T k_t)
    o_t  = S_t^T q_t

The chunked form follows :mod:`.gated_delta_rule`'s, with the decay per channel. Inside a chunk
that starts from ``S_0``, :math:`\gamma_{tc} = \sum_{s \le t} g_{sc}` and
:math:`D_{tjc} = e^{\gamma_{tc} - \gamma_{jc}}` for ``j <= t`` (a ``[C, C, K]`` tensor)::

    (I + A) U = diag(beta) V - diag(beta) (K o e^gamma) S_0,   A_tj = beta_t sum_c k_tc k_jc D_tjc  (j < t)
    O   = (Q o e^gamma) S_0 + M U,                           M_tj = sum_c q_tc k_jc D_tjc          (j <= t)
    S_C = diag(e^{gamma_C}) S_0 + (K o e^{gamma_C - gamma})^T U

Every exponent is ``<= 0``. The factored form ``(K o e^gamma)(K o e^-gamma)^T`` would save the
``[C, C, K]`` tensor but overflows: a channel's decay can be very strong. That tensor costs
``B * HV * T * C * K`` floats, so the default chunk is 16 (the result does not depend on it).

Layouts are fla's (``fla.ops.kda``): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV, K]``,
``beta [B, T, HV]``, states ``[N, HV, K, V]``. Packed sequences (``cu_seqlens``), the initial and
final state and the l2 normalisation of q and k are as in :mod:`.gated_delta_rule`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import pad

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.ops.fla.gated_delta_rule import check_options, run_scan

__all__ = ["chunk_kda", "fused_recurrent_kda"]


def _check_gate(v: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> None:
    expected = (*v.shape[:3], k.shape[-1])
    if g.shape != expected:
        raise ConfigError("g", tuple(g.shape), "give g as [batch, time, value_heads, head_dim]: one log-decay per key "
                          "channel", reason=f"q, k and v make that {expected}")


def _chunked_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form of the module docstring over [B, HV, T, .] float32 operands (g [B, HV, T, K])."""
    length = q.shape[2]
    if length == 0:
        return v.new_zeros(v.shape), state
    # Padded tokens: g = 0 (no decay), beta = 0 (no write); the final state is exact.
    padding = -length % chunk_size
    q, k, v, g = (pad(x, (0, 0, 0, padding)).unflatten(2, (-1, chunk_size)) for x in (q, k, v, g))
    beta = pad(beta, (0, padding)).unflatten(2, (-1, chunk_size))

    gamma = g.cumsum(dim=-2)  # [B, HV, n, C, K]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    gap = gamma.unsqueeze(-2) - gamma.unsqueeze(-3)  # [.., t, j, K]: gamma_t - gamma_j
    decay = torch.where(causal[..., None], gap, float("-inf")).exp()  # D, zero above the diagonal

    lower = (beta.unsqueeze(-1) * torch.einsum("...tc,...jc,...tjc->...tj", k, k, decay)).tril(-1)  # A
    write_v = torch.linalg.solve_triangular(lower, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    write_k = torch.linalg.solve_triangular(lower, beta.unsqueeze(-1) * k * gamma.exp(), upper=False,
                                            unitriangular=True)
    attend = torch.einsum("...tc,...jc,...tjc->...tj", q, k, decay)  # M, diagonal included
    read_q = q * gamma.exp()
    keep_k = k * (gamma[..., -1:, :] - gamma).exp()
    carry = gamma[..., -1, :].exp()[..., None]  # [B, HV, n, K, 1]: each row's decay over a chunk

    outputs = []
    for i in range(q.shape[2]):  # only the hand-over of the state between chunks is sequential
        writes = write_v[:, :, i] - write_k[:, :, i] @ state
        outputs.append(read_q[:, :, i] @ state + attend[:, :, i] @ writes)
        state = carry[:, :, i] * state + keep_k[:, :, i].transpose(-1, -2) @ writes
    return torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length], state


def _recurrent_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence itself, one token at a time, over [B, HV, T, .] float32 operands."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        written = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t].unsqueeze(-1) * written.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return o, state


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
              use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 16,
              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over whole sequences, chunk by chunk. Same call as ``fla.ops.kda.chunk_kda`` (its
    options that change the math, such as computing the gate in the kernel, are refused);
    returns ``(o, final_state)``."""
    check_options(kwargs, chunk_size, q, k, v, None, beta)
    _check_gate(v, k, g)

    def scan(*operands: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _chunked_scan(*operands, chunk_size=chunk_size)

    return run_scan(scan, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor | None = None, *, scale: float | None = None,
                        initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                        cu_seqlens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA token by token (decoding, or a reference for the chunked form); ``beta=None`` is a
    full write, as in fla."""
    check_options(kwargs, 1, q, k, v, None, beta)
    _check_gate(v, k, g)
    beta = v.new_ones(v.shape[:3]) if beta is None else beta
    return run_scan(_recurrent_scan, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel)
