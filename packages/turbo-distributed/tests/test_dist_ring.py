"""Ring attention on 4 gloo ranks against one full attention: outputs and gradients of
every chunk, with zig-zag and contiguous chunks, and with packed documents (float32)."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom

from fsdp_turbo.core.testing import run_distributed
from fsdp_turbo.distributed.context_parallel.ring import ring_attention
from fsdp_turbo.distributed.context_parallel.ring_math import chunk_positions, visible

pytestmark = pytest.mark.multirank
CP, SEQ = 4, 32
DOCUMENTS = torch.tensor([[0] * 9 + [1] * 14 + [2] * 9, [0] * 32])


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, SEQ, 8, generator=generator) for _ in range(4)]


def _rank(load_balance: bool, packed: bool):
    import torch.distributed as dist

    rank = dist.get_rank()
    q, k, v, grad_out = _inputs()
    mine = chunk_positions(SEQ, CP, rank, load_balance)
    documents = DOCUMENTS if packed else None
    masks = []
    for source in range(CP):
        theirs = chunk_positions(SEQ, CP, source, load_balance)
        docs = (documents[:, mine], documents[:, theirs]) if packed else (None, None)
        masks.append(visible(mine, theirs, *docs))
    leaves = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, 8 ** -0.5, masks, dist.group.WORLD)
    out.backward(grad_out[:, :, mine])
    return mine, out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize(("load_balance", "packed"), [(True, False), (False, False), (True, True)])
def test_ring_attention_equals_full_attention(load_balance, packed):
    q, k, v, grad_out = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = visible(torch.arange(SEQ), torch.arange(SEQ), DOCUMENTS, DOCUMENTS) if packed else None
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=not packed)
    expected.backward(grad_out)
    for mine, out, grads in run_distributed(_rank, CP, load_balance, packed, timeout=120):
        torch.testing.assert_close(out, expected.detach()[:, :, mine], rtol=1e-5, atol=1e-6)
        for got, leaf in zip(grads, leaves, strict=True):
            torch.testing.assert_close(got, leaf.grad[:, :, mine], rtol=1e-5, atol=1e-5)


class _Logged:
    """A P2P request whose ``wait`` is written to ``log``."""

    def __init__(self, request, log, label):
        self.request, self.log, self.label = request, log, label

    def wait(self):
        self.log.append(("wait", self.label))
        return self.request.wait()


def _rank_events():
    """Forward and backward of one ring call, logging each transfer's start and wait and
    each block computed, in order."""

    from fsdp_turbo.distributed.context_parallel import ring

    log, exchange, call_op = [], ring._exchange, ring.call_op
    labels = iter(range(10**6))

    def logged_exchange(tensors, group):
        label = next(labels)
        log.append(("start", label))
        received, requests = exchange(tensors, group)
        return received, [_Logged(r, log, label) for r in requests]

    def logged_op(name, *args):
        log.append(("block", name))
        return call_op(name, *args)

    ring._exchange, ring.call_op = logged_exchange, logged_op
    try:
        _rank(load_balance=True, packed=False)
    finally:
        ring._exchange, ring.call_op = exchange, call_op
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
