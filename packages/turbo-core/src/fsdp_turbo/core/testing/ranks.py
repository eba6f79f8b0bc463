"""What every rank runner shares: the forkserver, a rank's environment and group, and how
an outcome travels back and is raised (``harness`` forks ranks per call, ``pool`` keeps them).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

TEST_DEVICE_ENV = "FSDP_TURBO_TEST_DEVICE"
_POLL_S = 0.05
_GRACE_S = 15.0
# Ranks fork from a server that imported these once (``warm`` adds every installed FSDPTurbo
# transform), so a test does not pay for imports of torch, transformers and FSDPTurbo in
# each rank. Modules that fail to import are skipped by the forkserver.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "fsdp_turbo.core.testing.warm",
    "fsdp_turbo.fsdp_turbo",  # the facade (by name: core's own modules do not import it)
)
_context: mp.context.BaseContext | None = None


def _mp_context() -> mp.context.BaseContext:
    global _context
    if _context is None:
        # forkserver: a clean single-threaded parent for every rank (unlike fork after
        # OpenMP or store threads started), without spawn's cold imports.
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


class RankFailure(RuntimeError):
    """A rank died without a picklable exception (or was killed)."""


@dataclass
class _Outcome:
    ok: bool
    value: Any = None
    traceback: str = ""
    # CLOCK_MONOTONIC is system-wide on Linux, so ranks' failure times compare.
    when: float = field(default_factory=time.monotonic)


class _RemoteTraceback(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n" + self.args[0]


def device_under_test() -> str:
    """The device the suite runs on: ``$FSDP_TURBO_TEST_DEVICE`` (cpu, cuda or npu), default cpu."""
    return os.environ.get(TEST_DEVICE_ENV, "cpu").lower()


def _rank_environment(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun would set for a rank on this one host."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "FSDP_TURBO_DEVICE": device_under_test()}


def _join_group(rank: int, world_size: int, port: int, backend: str) -> None:
    """Join the call's process group, and return only once every rank has joined it.

    ``init_process_group`` no longer waits for the peers (torch removed its barrier), so a
    rank whose test fails at once, before any collective, could close its connections
    while a slower peer is still connecting, and that peer would fail with gloo's
    "Connection closed by peer" instead of the test's own error.
    """
    import torch.distributed as dist

    os.environ["MASTER_PORT"] = str(port)  # as torchrun sets it: where the job's store is
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    dist.barrier()


def _died(rank: int, exitcode: int | None) -> _Outcome:
    """The outcome of a rank that died with no result (killed, or crashed in native code).

    It is noticed here later than its peers' "connection reset" errors, which it caused, so
    it is dated first: the earliest failure is reported as the root cause.
    """
    if exitcode is not None and exitcode < 0:
        how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    return _Outcome(False, RankFailure(f"rank {rank} {how} and left no result (a crash's stack is on stderr)"),
                    "", float("-inf"))


# Plain CPU tensors travel as numpy arrays: torch's own pickling writes each storage through
# torch.save, several times slower for the thousands of small tensors a parity record holds.
_NUMPY_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def _tensor_from_numpy(array: Any) -> Any:
    import torch

    return torch.from_numpy(array)


class _OutcomePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        import torch

        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad
                and str(obj.dtype).removeprefix("torch.") in _NUMPY_DTYPES):
            return _tensor_from_numpy, (obj.resolve_conj().resolve_neg().numpy(),)
        return NotImplemented


def _payload(outcome: _Outcome) -> bytes:
    """``outcome`` pickled (an unpicklable result or error: its repr and traceback instead)."""
    buffer = io.BytesIO()
    try:
        _OutcomePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(outcome)
    except Exception:  # an unpicklable result or error: its repr and traceback still go back
        return pickle.dumps(_Outcome(False, RankFailure(repr(outcome.value)), outcome.traceback, outcome.when))
    return buffer.getvalue()


def _raise_from(rank: int, world_size: int, outcome: _Outcome) -> None:
    error = outcome.value
    if not isinstance(error, BaseException):
        error = RankFailure(repr(error))
    error.add_note(f"(raised on rank {rank} of {world_size})")
    raise error from _RemoteTraceback(outcome.traceback)
