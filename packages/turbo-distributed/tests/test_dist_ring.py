"""Ring attention on 4 gloo ranks against one full attention: outputs and gradients of
every chunk, with zig-zag and contiguous chunks, with packed documents, and with a sliding
window and attention sinks (float32)."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.core.testing import run_distributed
from fsdp_turbo.distributed.context_parallel.blocks import ring_steps
from fsdp_turbo.distributed.context_parallel.ring import ring_attention
from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions, visible

pytestmark = pytest.mark.multirank
CP, SEQ = 4, 32
DOCUMENTS = torch.tensor([[0] * 9 + [1] * 14 + [2] * 9, [0] * 32])


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, SEQ, 8, generator=generator) for _ in range(4)]


SINKS = torch.tensor([0.5, -1.0])  # one logit per head (gpt-oss), joined to every row with value 0


def _rank(load_balance: bool, packed: bool, window: int | None = None, sinks: bool = False,
          keep_rows: float | None = None):
    import torch.distributed as dist

    from fsdp_turbo.distributed.context_parallel import ring

    if keep_rows is not None:  # a shortened ring keeps received rows up to this share of its chunk
        ring.KEEP_ROWS = keep_rows
    rank = dist.get_rank()
    q, k, v, grad_out = _inputs()
    positions = [chunk_positions(SEQ, CP, source, load_balance) for source in range(CP)]
    mine = positions[rank]
    documents = DOCUMENTS if packed else None
    masks = []
    for theirs in positions:
        docs = (documents[:, mine], documents[:, theirs]) if packed else (None, None)
        masks.append(visible(mine, theirs, *docs, window=window))
    leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    sink = SINKS.clone().requires_grad_() if sinks else None
    out = ring_attention(*leaves, 8 ** -0.5, masks, dist.group.WORLD, sinks=sink, steps=ring_steps(positions, window))
    out.backward(grad_out[:, :, mine])
    return mine, out.detach(), [t.grad for t in leaves], None if sink is None else sink.grad


def _full_attention_with_sinks(q, k, v, mask, sinks):
    """gpt-oss's eager attention: the sink logit as one more column of the scores, dropped after the softmax."""
    scores = (q @ k.transpose(-1, -2) * 8 ** -0.5).masked_fill(~mask, float("-inf"))
    column = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v


@pytest.mark.parametrize(("load_balance", "packed"), [(True, False), (False, False), (True, True)])
def test_ring_attention_equals_full_attention(load_balance, packed):
    q, k, v, grad_out = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = visible(torch.arange(SEQ), torch.arange(SEQ), DOCUMENTS, DOCUMENTS) if packed else None
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=not packed)
    expected.backward(grad_out)
    for mine, out, grads, _ in run_distributed(_rank, CP, load_balance, packed, timeout=120):
        torch.testing.assert_close(out, expected.detach()[:, :, mine], rtol=1e-5, atol=1e-6)
        for got, leaf in zip(grads, leaves, strict=True):
            torch.testing.assert_close(got, leaf.grad[:, :, mine], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("load_balance", "keep_rows"), [(True, None), (False, 0.0), (False, 1.0)],
                         ids=["zig-zag", "contiguous, K/V sent again", "contiguous, K/V kept"])
def test_ring_attention_with_a_sliding_window_and_sinks_equals_full_attention(load_balance, keep_rows):
    """A window of 6 over chunks of 4 (zig-zag: every step still has a visible block) or 8
    (contiguous: only the previous rank's chunk is in reach, so the ring stops after 2 steps
    and each rank's dK/dV of its neighbour's rows go straight home; the backward has the
    neighbour's 5 rows sent again, or kept from the forward), with per-head sinks: output,
    dQ/dK/dV and the sinks' gradient (each rank's share, summed) equal one full attention."""
    window = 6
    positions = [chunk_positions(SEQ, CP, rank, load_balance) for rank in range(CP)]
    assert ring_steps(positions, window) == (CP if load_balance else 2)
    assert ring_steps(positions, None) == CP
    q, k, v, grad_out = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = SINKS.clone().requires_grad_()
    mask = visible(torch.arange(SEQ), torch.arange(SEQ), window=window)
    expected = _full_attention_with_sinks(*leaves, mask, sinks)
    expected.backward(grad_out)
    results = run_distributed(_rank, CP, load_balance, False, window, True, keep_rows, timeout=120)
    for mine, out, grads, _ in results:
        torch.testing.assert_close(out, expected.detach()[:, :, mine], rtol=1e-5, atol=1e-6)
        for got, leaf in zip(grads, leaves, strict=True):
            torch.testing.assert_close(got, leaf.grad[:, :, mine], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(r[3] for r in results), sinks.grad, rtol=1e-5, atol=1e-6)


class _Logged:
    """A P2P request whose ``wait`` is written to ``log``."""

    def __init__(self, request, log, label):
        self.request, self.log, self.label = request, log, label

    def wait(self):
        self.log.append(("wait", self.label))
        return self.request.wait()


def _rank_events(load_balance: bool = True, window: int | None = None, keep_rows: float | None = None):
    """Forward and backward of one ring call, logging each transfer's start and wait and
    each block computed, in order."""

    from fsdp_turbo.distributed.context_parallel import ring, ring_kernels

    log, exchange, call_op = [], ring._exchange, ring_kernels.call_op
    labels = iter(range(10**6))

    def logged_exchange(tensors, group, hops=1, rows=None):
        label = next(labels)
        log.append(("start", label))
        received, requests = exchange(tensors, group, hops, rows)
        return received, [_Logged(r, log, label) for r in requests]

    def logged_op(name, *args):
        log.append(("block", name))
        return call_op(name, *args)

    ring._exchange, ring_kernels.call_op = logged_exchange, logged_op
    try:
        _rank(load_balance=load_balance, packed=False, window=window, keep_rows=keep_rows)
    finally:
        ring._exchange, ring_kernels.call_op = exchange, call_op
    return log


def test_every_transfer_but_the_last_hides_behind_a_block():
    """Zig-zag chunks give every rank work on every chunk, so each transfer (forward: K/V;
    backward: K/V and the dK/dV sums) has a block computed between its start and its wait;
    only the backward's last hop, the sums going home, has nothing left to hide behind."""
    for log in run_distributed(_rank_events, CP, timeout=120):
        starts = {label: i for i, (kind, label) in enumerate(log) if kind == "start"}
        assert len(starts) == (CP - 1) + (CP - 1) + CP  # forward K/V, backward K/V, backward sums
        exposed = []
        for i, (kind, label) in enumerate(log):
            if kind == "wait" and not any(k == "block" for k, _ in log[starts[label]:i]):
                exposed.append(label)
        assert set(exposed) == {max(starts)}, exposed


@pytest.mark.parametrize("keep", [False, True], ids=["K/V sent again", "K/V kept"])
def test_a_shortened_rings_gradients_go_straight_home(keep):
    """A window of 6 over contiguous chunks of 8: the ring stops after 2 steps, and its forward
    sends the 5 rows the window reaches. Its backward sends each rank's dK/dV of its
    neighbour's rows straight home, after its blocks, and waits on them last; the neighbour's
    rows travel again (one K/V transfer, hidden behind the own chunk's block) unless the
    forward kept them (``KEEP_ROWS``): then the backward sends no K/V."""
    for log in run_distributed(_rank_events, CP, False, 6, 1.0 if keep else 0.0, timeout=120):
        starts = [i for i, (kind, _) in enumerate(log) if kind == "start"]
        # forward K/V rows, [backward K/V rows,] backward dK/dV home
        assert len(starts) == (2 if keep else 3), log
        backward = [i for i, event in enumerate(log) if event == ("block", "cp.ring_block_backward")]
        assert backward and max(backward) < starts[-1], log
        assert all(kind == "wait" for kind, _ in log[starts[-1] + 1 :]), log


# The block map on 4 ranks against one full attention: a window shorter than a chunk (the ring
# ships only the rows it reaches), packed documents over zig-zag chunks, a chunked layer, right
# padding; blocks of 4 query rows, so every cut tile is split.
LONG, BLOCK = 64, 4
MASKS = {
    "window": {"load_balance": False, "window": 6, "sinks": True},
    # a window the blocks divide: each block's lower edge is an upper triangle, computed reversed
    "window of two blocks": {"load_balance": True, "window": 8},
    "documents": {"load_balance": True, "documents": torch.tensor([[0] * 10 + [1] * 30 + [2] * 24,
                                                                   [0] * 33 + [1] * 31])},
    "chunk": {"load_balance": False, "chunk": 12},
    # contiguous chunks of 16: the ring stops after 2 steps and ships only what the documents reach
    "documents contiguous": {"load_balance": False, "documents": torch.tensor([[0] * 20 + [1] * 14 + [2] * 30,
                                                                              [0] * 12 + [1] * 20 + [2] * 32])},
    "padding": {"load_balance": True, "padding": torch.tensor([[True] * 50 + [False] * 14, [True] * 64])},
}


def _long_inputs():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 4, LONG, 8, generator=generator) if i != 1 and i != 2 else
            torch.randn(2, 2, LONG, 8, generator=generator) for i in range(4)]  # q, k, v (2 K/V heads), grad


def _full_mask(case: dict) -> torch.Tensor:
    index = torch.arange(LONG)
    documents = case.get("documents")
    mask = visible(index, index, documents, documents, window=case.get("window"))
    if "chunk" in case:
        blocks = index // case["chunk"]
        mask = mask & (blocks[:, None] == blocks[None, :])
    if "padding" in case:
        mask = mask & case["padding"][:, None, None, :]
    return mask


def _block_rank(mode: str, name: str, whole: bool):
    import torch.distributed as dist

    from fsdp_turbo.distributed.context_parallel.blocks import ring_tiles, shipped_rows
    from fsdp_turbo.distributed.context_parallel.context import ForwardContext
    from fsdp_turbo.distributed.context_parallel.kv_allgather import kv_allgather_attention

    case = MASKS[name]
    rank = dist.get_rank()
    q, k, v, grad_out = _long_inputs()
    positions = [chunk_positions(LONG, CP, source, case["load_balance"]) for source in range(CP)]
    mine = positions[rank]
    context = ForwardContext(LONG, padding_mask=case.get("padding"), documents=case.get("documents"),
                             ring_positions=positions)
    window, chunk = case.get("window"), case.get("chunk")
    tiles = ring_tiles(context, rank, torch.device("cpu"), window, chunk, block=BLOCK, whole_blocks=whole)
    leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    sink = SINKS.repeat(2).clone().requires_grad_() if case.get("sinks") else None
    plain = "documents" not in case and "padding" not in case
    if mode == "ring":
        reach = chunk if plain else None
        starts = context.document_starts() if "documents" in case else None
        out = ring_attention(*leaves, 8 ** -0.5, tiles, dist.group.WORLD, sinks=sink,
                             steps=ring_steps(positions, window, reach, starts),
                             shipped=shipped_rows(positions, window, reach, starts))
    else:
        out = kv_allgather_attention(*leaves, 8 ** -0.5, tiles, dist.group.WORLD, sinks=sink)
    out.backward(grad_out[:, :, mine])
    return mine, out.detach(), [t.grad for t in leaves], None if sink is None else sink.grad


def _every_mask(mode: str) -> dict:
    return {(name, whole): _block_rank(mode, name, whole) for name in MASKS for whole in (False, True)}


def _expected(case: dict):
    q, k, v, grad_out = _long_inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    keys, values = (t.repeat_interleave(2, dim=1) for t in leaves[1:])
    mask = _full_mask(case)
    sinks = None
    if case.get("sinks"):
        sinks = SINKS.repeat(2).clone().requires_grad_()
        expected = _full_attention_with_sinks(leaves[0], keys, values, mask, sinks)
    else:
        expected = F.scaled_dot_product_attention(leaves[0], keys, values, attn_mask=mask)
    expected.backward(grad_out)
    return expected.detach(), leaves, sinks


@pytest.mark.parametrize("mode", ["ring", "kv_allgather"])
def test_block_sparse_attention_equals_full_attention(mode):
    """Under each mask (one launch for all): output, dQ/dK/dV (GQA: 4 query heads on 2 K/V
    heads) and the sinks' gradient equal one full attention, for the ring (with its shortened,
    trimmed sends) and the KV all-gather; each with a cut block's keys in up to three tiles and
    in one (``whole_blocks``, what CPU runs)."""
    results = run_distributed(_every_mask, CP, mode, timeout=120)
    for (name, whole), case in ((key, MASKS[key[0]]) for key in results[0]):
        expected, leaves, sinks = _expected(case)
        label = f"{name}, whole blocks {whole}"
        for rank_results in results:
            mine, out, grads, _ = rank_results[name, whole]
            torch.testing.assert_close(out, expected[:, :, mine], rtol=1e-5, atol=1e-6, msg=label)
            for got, leaf in zip(grads, leaves, strict=True):
                torch.testing.assert_close(got, leaf.grad[:, :, mine], rtol=1e-5, atol=1e-5, msg=label)
        if sinks is not None:
            torch.testing.assert_close(sum(r[name, whole][3] for r in results), sinks.grad, rtol=1e-5, atol=1e-6,
                                       msg=label)
