"""The ``domino`` schedule: token slices whose all-to-alls hide behind each other's expert
GEMMs, in the forward and in the backward (DeepSpeed's Domino, for expert parallel).

The local tokens are cut into independent slices (``ep_plan.num_chunks``, 2 by default).
Forward, for two slices::

    issue dispatch 0, issue dispatch 1
    wait dispatch 0 -> experts 0 -> issue combine 0      (dispatch 1 in flight)
    wait dispatch 1 -> experts 1 -> issue combine 1      (combine 0 in flight)
    wait combine 0, wait combine 1

Backward, the mirror image::

    issue combine-grad 1, issue combine-grad 0
    wait combine-grad 1 -> experts 1 backward -> issue dispatch-grad 1   (combine-grad 0 in flight)
    wait combine-grad 0 -> experts 0 backward -> issue dispatch-grad 0   (dispatch-grad 1 in flight)
    wait dispatch-grad 1, wait dispatch-grad 0

``mc2`` pipelines its chunks in the forward only: its all-to-all is torch's autograd
collective, whose backward waits for its own result, so its backward is serial. Here every
all-to-all is one :class:`InFlight` exchange, and two things give the backward its overlap:

1. Issue and wait are apart in the backward too. An exchange's autograd node issues the
   reverse all-to-all (``async_op=True``: gloo runs it on its own thread, so the overlap
   is real on CPU) and hands autograd the buffer being filled; the wait is a pre-hook on
   the node that consumes that buffer (the slice's expert backward, or its send-rows
   backward), so it runs only when that gradient is needed.
2. The autograd engine runs the ready node with the highest sequence number, that is the
   one created last in the forward (``CompareNodeTaskTime`` in torch's ``engine.h``). So an
   exchange's node is created when it *lands* (is waited on), not when it is issued: every
   slice's combine node is then younger than every slice's experts, so the backward issues
   all combine gradients before any expert backward runs; slice ``i + 1``'s dispatch node is
   younger than slice ``i``'s experts, so its gradient leaves before slice ``i``'s expert
   backward starts. If an engine ever picked another order, the numbers would stay right;
   only the overlap would be lost (``test_dist_ep_domino`` pins the order by events).

Events: while :func:`event_hook` is active, ``hook(event, slice)`` is called at each step:
``dispatch_issue``, ``dispatch_wait``, ``experts`` (before the slice's expert GEMMs),
``combine_issue``, ``combine_wait``; in the backward ``combine_grad_issue``,
``combine_grad_wait`` (the slice's expert backward starts), ``dispatch_grad_issue`` (it has
ended) and ``dispatch_grad_wait``. With one EP rank nothing is exchanged and no backward
events are recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

EventHook = Callable[[str, int], None]
"""``hook(event, slice)``: one step of the schedule (see the module docstring)."""

_hook: EventHook | None = None


@contextlib.contextmanager
def event_hook(hook: EventHook) -> Iterator[None]:
    """Call ``hook(event, slice)`` at every step of the schedule while the block runs (the
    backward included, if it runs inside the block)."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous


def _emit(event: str, index: int) -> None:
    if _hook is not None:
        _hook(event, index)


class _Transfer:
    """An uneven all-to-all in flight (``async_op``): ``rows`` go ``in_splits[r]`` to rank ``r``
    and ``out_splits[r]`` come back from it. It holds the tensors the collective reads and
    fills until :meth:`wait`."""

    def __init__(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group: dist.ProcessGroup) -> None:
        self.sent = rows.contiguous()
        self.received = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        self.work = dist.all_to_all_single(self.received, self.sent, out_splits, in_splits, group=group,
                                           async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.received


class InFlight:
    """One slice's all-to-all, issued at construction and waited on by :meth:`land`.

    ``rows`` go ``in_splits[r]`` to rank ``r``; ``out_splits[r]`` come back from it. Without a
    group (one EP rank) nothing is exchanged and :meth:`land` returns ``rows``."""

    def __init__(self, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                 group: dist.ProcessGroup | None, label: str, index: int) -> None:
        self.splits, self.group, self.label, self.index = (out_splits, in_splits), group, label, index
        self._rows: torch.Tensor | None = rows  # the autograd edge, until the node is created
        self._transfer = None if group is None else _Transfer(rows.detach(), out_splits, in_splits, group)
        self._grad_transfer: _Transfer | None = None
        self._wait_in_backward = False
        _emit(f"{label}_issue", index)

    def land(self) -> torch.Tensor:
        """Wait for the rows and create the exchange's autograd node now (see the module
        docstring: the node's age decides when its backward runs)."""
        rows, self._rows = self._rows, None
        if self._transfer is None:
            _emit(f"{self.label}_wait", self.index)
            return rows
        if rows.grad_fn is not None:
            # The gradient buffer is still being filled when autograd gets it: its consumer waits.
            rows.grad_fn.register_prehook(self._wait_grad)
        self._wait_in_backward = rows.grad_fn is None  # a leaf's AccumulateGrad would read it at once
        return _Landing.apply(rows, self)

    def wait_rows(self) -> torch.Tensor:
        """Block until the rows have arrived; return them (``_Landing``'s forward)."""
        transfer, self._transfer = self._transfer, None
        received = transfer.wait()
        _emit(f"{self.label}_wait", self.index)
        return received

    def send_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Issue the reverse all-to-all of ``grad``; return the buffer it fills."""
        out_splits, in_splits = self.splits
        self._grad_transfer = _Transfer(grad, in_splits, out_splits, self.group)
        _emit(f"{self.label}_grad_issue", self.index)
        grad_rows = self._grad_transfer.received
        if self._wait_in_backward:
            self._wait_grad()
        return grad_rows

    def _wait_grad(self, *_grad_outputs) -> None:
        transfer, self._grad_transfer = self._grad_transfer, None
        if transfer is None:  # the consumer was reached by another path only
            return
        transfer.wait()
        _emit(f"{self.label}_grad_wait", self.index)


class _Landing(torch.autograd.Function):
    """The exchange's autograd node: forward waits for the rows, backward issues the
    gradients' all-to-all without waiting for it."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, flight: InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.wait_rows()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.flight.send_grad(grad), None


def overlap_slices(count: int, send: Callable[[int], InFlight],
                   compute: Callable[[int, torch.Tensor], InFlight]) -> list[torch.Tensor]:
    """Run ``count`` slices: ``send(i)`` issues slice ``i``'s dispatch; ``compute(i, received)``
    runs its experts and issues its combine. Returns each slice's combined-back rows.

    Slice ``i + 1``'s dispatch is issued before slice ``i``'s experts run; every combine lands
    after the last slice's experts, which orders the backward (module docstring)."""
    dispatches = {0: send(0)} if count else {}
    combines = []
    for i in range(count):
        if i + 1 < count:
            dispatches[i + 1] = send(i + 1)
        received = dispatches.pop(i).land()
        _emit("experts", i)
        combines.append(compute(i, received))
    return [flight.land() for flight in combines]
