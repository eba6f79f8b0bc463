"""Ring attention's arithmetic in one process: the ring is simulated by visiting every
key/value chunk of every rank's queries; outputs and gradients must equal one full causal
attention (float32)."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.distributed.context_parallel.ring_math import (
    block_attention,
    block_grads,
    chunk_positions,
    merge,
    visible,
    zigzag_chunks,
)


def _inputs(seq=16, heads=2, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, seq, dim, generator=generator) for _ in range(4)]  # q, k, v, grad_out


def _ring(q, k, v, grad_out, cp, load_balance, documents=None):
    """Each simulated rank: its queries against every rank's keys, merged; then the grads."""
    seq, scale = q.shape[2], q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        qpos = chunk_positions(seq, cp, rank, load_balance)
        partial, lse = None, None
        blocks = []
        for source in range(cp):
            kpos = chunk_positions(seq, cp, source, load_balance)
            docs = (documents[:, qpos], documents[:, kpos]) if documents is not None else (None, None)
            mask = visible(qpos, kpos, *docs)
            blocks.append((kpos, mask))
            block_out, block_lse = block_attention(q[:, :, qpos], k[:, :, kpos], v[:, :, kpos], scale, mask)
            partial, lse = ((block_out, block_lse) if partial is None
                            else merge(partial, lse, block_out, block_lse))
        out[:, :, qpos] = partial
        for kpos, mask in blocks:
            dq, dk, dv = block_grads(q[:, :, qpos], k[:, :, kpos], v[:, :, kpos], scale, mask, partial, lse,
                                     grad_out[:, :, qpos])
            grads[0][:, :, qpos] += dq
            grads[1][:, :, kpos] += dk
            grads[2][:, :, kpos] += dv
    return out, grads


def _reference(q, k, v, grad_out, mask=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if mask is None:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def test_zigzag_gives_every_rank_the_same_causal_work():
    assert zigzag_chunks(4) == [(0, 7), (1, 6), (2, 5), (3, 4)]
    work = [int(visible(chunk_positions(64, 4, r, True), torch.arange(64)).sum()) for r in range(4)]
    assert len(set(work)) == 1
    contiguous = [int(visible(chunk_positions(64, 4, r, False), torch.arange(64)).sum()) for r in range(4)]
    assert contiguous[-1] > 3 * contiguous[0]
    assert torch.cat([chunk_positions(64, 4, r, True) for r in range(4)]).sort().values.equal(torch.arange(64))


@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_equals_full_causal_attention(cp, load_balance):
    q, k, v, grad_out = _inputs()
    out, grads = _ring(q, k, v, grad_out, cp, load_balance)
    expected, expected_grads = _reference(q, k, v, grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_documents_stay_apart_in_the_ring():
    q, k, v, grad_out = _inputs()
    documents = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    out, grads = _ring(q, k, v, grad_out, 4, True, documents)
    mask = visible(torch.arange(16), torch.arange(16), documents, documents)
    expected, expected_grads = _reference(q, k, v, grad_out, mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_block_a_row_cannot_see_contributes_nothing():
    q, k, v, _ = _inputs(seq=4)
    nothing = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    out, lse = block_attention(q, k, v, 0.5, nothing)
    assert torch.isinf(lse).all() and out.eq(0).all()
    full_out, full_lse = block_attention(q, k, v, 0.5, None)
    merged, merged_lse = merge(out, lse, full_out, full_lse)
    assert merged.equal(full_out) and merged_lse.equal(full_lse)


def test_the_cpu_flash_kernels_equal_the_portable_ones():
    """Including a block where some query rows see nothing (another document's keys)."""
    from fsdp_turbo.distributed.context_parallel.ring_kernels import cpu_flash_backward, cpu_flash_forward

    q, k, v, grad_out = _inputs(seq=8)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8])
    masks = [None, visible(torch.arange(8), torch.arange(8)), visible(torch.arange(4, 12), torch.arange(8)),
             visible(torch.arange(8), torch.arange(8), documents, torch.zeros(2, 8, dtype=torch.long))]
    for mask in masks:
        out, lse = block_attention(q, k, v, 0.3, mask)
        flash_out, flash_lse = cpu_flash_forward(q, k, v, 0.3, mask)
        torch.testing.assert_close(flash_out, out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(flash_lse, lse, rtol=1e-5, atol=1e-6)  # -inf where a row sees nothing
        final_out, final_lse = block_attention(q, k, v, 0.3, None)  # what the ring passes back: finite
        for got, want in zip(cpu_flash_backward(q, k, v, 0.3, mask, final_out, final_lse, grad_out),
                             block_grads(q, k, v, 0.3, mask, final_out, final_lse, grad_out), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_cpu_kernels_blind_rows_follow_each_mask():
    """The CPU kernels find a mask's rows that see no key once and keep them while the mask
    lives: pairs of masks of one shape, alive at once, one of them with a row that sees
    nothing, made and dropped one pair after another (so a new one may take a dropped one's
    address), each get their own numbers, and the record empties as they go."""
    import gc

    from fsdp_turbo.distributed.context_parallel import ring_kernels

    q, k, v, grad_out = _inputs(seq=8)
    before = len(ring_kernels._BLIND)
    generator = torch.Generator().manual_seed(3)
    final_out, final_lse = block_attention(q, k, v, 0.3, None)
    for _ in range(3):
        masks = [torch.rand(2, 1, 8, 8, generator=generator) < 0.5 for _ in range(2)]
        for index, mask in enumerate(masks):
            mask[..., 0] = True  # every row sees a key, but
            mask[0, 0, 5] = index == 0  # in one of the two masks alive at once one row sees nothing
        for mask in masks * 2:  # the second round reads the record
            out, lse = ring_kernels.cpu_flash_forward(q, k, v, 0.3, mask)
            want_out, want_lse = block_attention(q, k, v, 0.3, mask)
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)  # -inf on the blind row
            for got, want in zip(ring_kernels.cpu_flash_backward(q, k, v, 0.3, mask, final_out, final_lse, grad_out),
                                 block_grads(q, k, v, 0.3, mask, final_out, final_lse, grad_out), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        del mask, masks
        gc.collect()
        assert len(ring_kernels._BLIND) == before


def test_merging_into_a_view_writes_the_pure_merge():
    """The ring merges each tile into its rows of the running output in place: the same numbers
    as ``merge``, the other rows untouched."""
    from fsdp_turbo.distributed.context_parallel.ring_math import merge_into

    q, k, v, _ = _inputs(seq=8)
    out, lse = block_attention(q, k, v, 0.5, visible(torch.arange(8), torch.arange(8)))
    block_out, block_lse = block_attention(q[:, :, 2:6], k, v, 0.5, None)
    want_out, want_lse = merge(out[:, :, 2:6], lse[:, :, 2:6], block_out, block_lse)
    running_out, running_lse = out.clone(), lse.clone()
    merge_into(running_out[:, :, 2:6], running_lse[:, :, 2:6], block_out, block_lse)
    torch.testing.assert_close(running_out[:, :, 2:6], want_out, rtol=0, atol=1e-6)
    assert running_lse[:, :, 2:6].equal(want_lse)
    rest = [0, 1, 6, 7]
    assert running_out[:, :, rest].equal(out[:, :, rest]) and running_lse[:, :, rest].equal(lse[:, :, rest])


def _gqa_paths() -> list[bool]:
    # natively where this torch's CPU flash kernels take GQA, and on copies everywhere
    from fsdp_turbo.distributed.context_parallel.ring_kernels import NATIVE_GQA

    return [True, False] if NATIVE_GQA else [False]


@pytest.mark.parametrize("native", _gqa_paths(), ids=lambda native: "native" if native else "copied")
def test_the_block_kernels_take_fewer_kv_heads_than_query_heads(monkeypatch, native):
    """GQA: 4 query heads over 2 K/V heads equal the same kernels on K/V copied per query head,
    dK/dV summed back per K/V head; the CPU kernels natively (torch >= 2.13) or on copies."""
    from fsdp_turbo.distributed.context_parallel import ring_kernels

    monkeypatch.setattr(ring_kernels, "NATIVE_GQA", native)
    q, grad_out = _inputs(seq=8, heads=4)[::3]
    k, v = _inputs(seq=8, heads=2, seed=1)[:2]
    wide_k, wide_v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    mask = visible(torch.arange(4, 12), torch.arange(8))
    final_out, final_lse = block_attention(q, wide_k, wide_v, 0.3, None)
    for forward, backward in ((ring_kernels.portable_forward, ring_kernels.portable_backward),
                              (ring_kernels.cpu_flash_forward, ring_kernels.cpu_flash_backward)):
        out, lse = forward(q, k, v, 0.3, mask)
        want_out, want_lse = block_attention(q, wide_k, wide_v, 0.3, mask)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
        dq, dk, dv = backward(q, k, v, 0.3, mask, final_out, final_lse, grad_out)
        want_dq, want_dk, want_dv = block_grads(q, wide_k, wide_v, 0.3, mask, final_out, final_lse, grad_out)
        torch.testing.assert_close(dq, want_dq, rtol=1e-5, atol=1e-6)
        for got, want in ((dk, want_dk), (dv, want_dv)):
            assert got.shape == k.shape
            torch.testing.assert_close(got, want.unflatten(1, (2, 2)).sum(2), rtol=1e-5, atol=1e-6)
