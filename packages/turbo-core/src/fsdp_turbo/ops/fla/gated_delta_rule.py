r"""Portable (plain PyTorch) gated delta rule: a chunked form for training and a
token-by-token form for decoding, both differentiable by autograd.

The recurrence, per (sequence, value head), with state :math:`S \in \mathbb{R}^{K \times V}`,
:math:`\alpha_t = e^{g_t}` (``g`` is a log-decay, ``<= 0``) and write strength
:math:`\beta_t`::

    S_t = alpha_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t)
    o_t = S_t^T q_t                                   (q scaled by 1/sqrt(K) by default)

``u_t`` is what the delta rule writes: the part of ``v_t`` the decayed state does not
already predict from ``k_t``.

The chunked form. Inside a chunk of ``C`` tokens that starts from state ``S_0``, let
:math:`\gamma_t = \sum_{s \le t} g_s` (log-decay since the chunk start) and
:math:`D_{tj} = e^{\gamma_t - \gamma_j}` for ``j <= t`` (0 above the diagonal). Unrolling
the recurrence gives, with ``U`` the rows ``u_t``::

    S_t = e^{gamma_t} S_0 + sum_{j<=t} D_tj k_j u_j^T
    (I + A) U = diag(beta) V - diag(beta e^{gamma}) K S_0,   A_tj = beta_t D_tj k_t.k_j  (j < t)

``I + A`` is unit lower triangular, so one triangular solve per chunk turns the ``C``
sequential writes into matmuls: ``U = P - W S_0`` with ``P = (I+A)^{-1} diag(beta) V`` and
``W = (I+A)^{-1} diag(beta e^gamma) K``, both independent of ``S_0`` and so computed for
every chunk at once. Only the hand-over of the state is sequential::

    O       = diag(e^gamma) Q S_0 + ((Q K^T) * D) U
    S_C     = e^{gamma_C} S_0 + (diag(e^{gamma_C - gamma}) K)^T U

Every exponent is ``<= 0`` (``g <= 0``), so nothing overflows; the mask goes on before
the exponential so the entries above the diagonal are exact zeros.

Layouts follow ``fla`` (flash-linear-attention): ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``,
``g, beta [B, T, HV]``, states ``[N, HV, K, V]``; ``HV`` a multiple of ``H`` (grouped value
attention: query/key head ``h`` serves value heads ``h*HV/H .. (h+1)*HV/H - 1``). Computation
is in float32; the output comes back in ``q``'s dtype, the final state in float32.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.functional import pad

from fsdp_turbo.core.errors import ConfigError

__all__ = ["check_options", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "l2norm", "run_scan"]

L2NORM_EPS = 1e-6  # fla's (and transformers') epsilon under the square root

# fla options that change the math and that the portable kernels do not implement: refused when
# set (not None / False) rather than ignored. Any other keyword is ignored, as fla and transformers'
# references do: a model forwards its own keywords (position ids, attention flags) to the op.
_UNSUPPORTED_OPTIONS = ("use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first",
                        "transpose_state_layout", "cp_context", "gk", "gv")

# One form's whole scan: (q, k, v, g, beta, state) in the head-major float32 layouts
# [B, HV, T, .] and [B, HV, K, V] -> (o [B, HV, T, V], final state [B, HV, K, V]).
_Scan = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim, as fla normalizes q and k in the kernel."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    for option in _UNSUPPORTED_OPTIONS:
        value = kwargs.get(option)
        if value is not None and value is not False:
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else value
            raise ConfigError(option, shown, f"leave {option} unset: the portable gated delta rule does not "
                                             "implement it (fla's CUDA kernels do)")


def check_options(kwargs: dict[str, Any], chunk_size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  g: torch.Tensor | None, beta: torch.Tensor | None) -> None:
    """The checks every op of this family makes: options it does not implement refused, a
    positive int chunk size, and the operands' shapes (``g`` checked here only when it has one
    value per value head)."""
    _refuse_unsupported(kwargs)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError("chunk_size", chunk_size, "give a positive int (fla's CUDA kernels take 16, 32 or 64)")
    _check_shapes(q, k, v, g, beta)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                  beta: torch.Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ConfigError("q", tuple(q.shape), "give q and k of one shape [batch, time, heads, head_dim]",
                          reason=f"k is {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ConfigError("v", tuple(v.shape), "give v as [batch, time, value_heads, value_dim] with value_heads "
                          f"a multiple of q's {q.shape[2]} heads")
    for name, gate in (("g", g), ("beta", beta)):
        if gate is not None and gate.shape != v.shape[:3]:
            raise ConfigError(name, tuple(gate.shape), f"give {name} as [batch, time, value_heads]",
                              reason=f"v makes that {tuple(v.shape[:3])}")


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float | None, use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, ...]:
    """The float32, head-major [B, HV, T, .] operands, q scaled, q and k normalized if asked."""
    groups = v.shape[2] // q.shape[2]
    if groups > 1:  # grouped value attention: each query/key head serves `groups` consecutive value heads
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q * (k.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def _start_state(initial_state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor, count: int) -> torch.Tensor:
    shape = (count, v.shape[2], q.shape[3], v.shape[3])
    if initial_state is None:
        return v.new_zeros(shape, dtype=torch.float32)
    if tuple(initial_state.shape) != shape:
        raise ConfigError("initial_state", tuple(initial_state.shape),
                          f"give one state per sequence: [sequences, value_heads, head_dim, value_dim] = {shape}")
    return initial_state.float()


def _segments(cu_seqlens: torch.Tensor | Sequence[int], q: torch.Tensor) -> list[int]:
    """The boundaries of packed sequences, checked: 0 first, the packed length last, never decreasing."""
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if q.shape[0] != 1:
        raise ConfigError("cu_seqlens", bounds, "pack the sequences into batch size 1 ([1, total_tokens, ...]) "
                          "when passing cu_seqlens", reason=f"the batch size is {q.shape[0]}")
    ordered = all(a <= b for a, b in itertools.pairwise(bounds))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != q.shape[1] or not ordered:
        raise ConfigError("cu_seqlens", bounds, f"give non-decreasing offsets from 0 to the packed length {q.shape[1]}")
    return bounds


def run_scan(scan: _Scan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
         cu_seqlens: torch.Tensor | Sequence[int] | None, use_qk_l2norm_in_kernel: bool,
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared by every form (and KDA's, :mod:`.kda`): layout in and out, and packed sequences run
    one by one, each from its own initial state (a sequence never sees its neighbours' tokens)."""
    out_dtype = q.dtype
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    if cu_seqlens is None:
        o, state = scan(qh, kh, vh, gh, bh, _start_state(initial_state, q, v, q.shape[0]))
    else:
        bounds = _segments(cu_seqlens, q)
        states = _start_state(initial_state, q, v, len(bounds) - 1)
        pieces = [scan(*(x[:, :, a:b] for x in (qh, kh, vh, gh, bh)), states[i:i + 1])
                  for i, (a, b) in enumerate(itertools.pairwise(bounds))]
        o = torch.cat([piece[0] for piece in pieces], dim=2)
        state = torch.cat([piece[1] for piece in pieces], dim=0)
    o = o.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format)  # fla's layout, contiguous as fla's
    return o, (state if output_final_state else None)


def _chunked_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form of the module docstring, over [B, HV, T, .] float32 operands."""
    length = q.shape[2]
    if length == 0:
        return v.new_zeros(v.shape), state
    # Pad to whole chunks with g = 0 (no decay) and beta = 0 (no write): a padded token
    # leaves the state as it is, so the final state is exact; its outputs are cut off.
    padding = -length % chunk_size
    q, k, v = (pad(x, (0, 0, 0, padding)).unflatten(2, (-1, chunk_size)) for x in (q, k, v))
    g, beta = (pad(x, (0, padding)).unflatten(2, (-1, chunk_size)) for x in (g, beta))

    gamma = g.cumsum(dim=-1)  # [B, HV, n, C]: log-decay from each chunk's start through token t
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, gamma.unsqueeze(-1) - gamma.unsqueeze(-2), float("-inf")).exp()  # D

    lower = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # A, strictly lower
    # unitriangular: the solve reads only A's strict lower part and takes the diagonal as 1, i.e. solves (I + A)
    write_v = torch.linalg.solve_triangular(lower, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)  # P
    write_k = torch.linalg.solve_triangular(lower, (beta * gamma.exp()).unsqueeze(-1) * k,
                                            upper=False, unitriangular=True)  # W
    attend = (q @ k.transpose(-1, -2)) * decay  # (Q K^T) * D, diagonal included
    read_q = q * gamma.exp().unsqueeze(-1)  # diag(e^gamma) Q: reads the chunk's start state
    keep_k = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)  # decay of each write to the chunk's end
    carry = gamma[..., -1].exp()[..., None, None]  # e^{gamma_C}: the start state's decay over a chunk

    outputs = []
    for i in range(q.shape[2]):  # only the hand-over of the state between chunks is sequential
        writes = write_v[:, :, i] - write_k[:, :, i] @ state  # U
        outputs.append(read_q[:, :, i] @ state + attend[:, :, i] @ writes)
        state = carry[:, :, i] * state + keep_k[:, :, i].transpose(-1, -2) @ writes
    return torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :length], state


def _recurrent_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence itself, one token at a time, over [B, HV, T, .] float32 operands."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, :, t], state)
        written = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k[:, :, t].unsqueeze(-1) * written.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return o, state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                           use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences, chunk by chunk (see the module docstring).

    Same call as ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``; returns ``(o, final_state)``,
    ``final_state`` None unless ``output_final_state``. ``cu_seqlens``: offsets of sequences packed
    into batch 1, each run independently. ``chunk_size`` (any positive int) changes the work split,
    not the result. Options after ``beta`` are keyword-only: fla and transformers order them
    differently, and a positional call must not bind ``scale`` to one and ``chunk_size`` to the other.
    """
    check_options(kwargs, chunk_size, q, k, v, g, beta)

    def scan(*operands: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _chunked_scan(*operands, chunk_size=chunk_size)

    return run_scan(scan, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor | None = None, beta: torch.Tensor | None = None, *,
                                     scale: float | None = None, initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token (decoding, or a reference for the chunked form).

    Same call as ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``: as
    :func:`chunk_gated_delta_rule`, and as in fla ``g=None`` means no decay and ``beta=None``
    a full write (``beta = 1``).
    """
    check_options(kwargs, 1, q, k, v, g, beta)
    g = v.new_zeros(v.shape[:3]) if g is None else g
    beta = v.new_ones(v.shape[:3]) if beta is None else beta
    return run_scan(_recurrent_scan, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel)
