"""The one device layer: which accelerator, which backend, streams and pinned memory.

``torch_npu`` is imported here lazily, and only when the NPU is asked for, so
import never breaks on machines without it. CPU gets no-op streams.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from fsdp_turbo.core.errors import ConfigError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEVICE_ENV = "FSDP_TURBO_DEVICE"


def _load_npu() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return True


def detect_device_type(requested: str | None = None) -> str:
    """``requested``, else ``$FSDP_TURBO_DEVICE``, else the current accelerator, else cpu."""
    choice = requested or os.environ.get(DEVICE_ENV) or None
    if choice is not None:
        choice = choice.lower()
        if choice not in BACKENDS:
            raise ConfigError("device_type", choice, f"use one of {sorted(BACKENDS)}")
        if choice == "npu" and not _load_npu():
            raise ConfigError("device_type", "npu", "pip install 'turbo-core[npu]' (torch_npu)",
                              reason="torch_npu is not installed")
        return choice
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator.type if accelerator is not None else "cpu"


def backend_for(device_type: str) -> str:
    return BACKENDS.get(device_type, "gloo")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def current_device(device_type: str) -> torch.device:
    """The device this process computes on; sets the accelerator index from LOCAL_RANK."""
    if device_type == "cpu":
        return torch.device("cpu")
    index = local_rank() % max(torch.accelerator.device_count(), 1)
    torch.accelerator.set_device_index(index)
    return torch.device(device_type, index)


def init_process_group(device_type: str, timeout_s: float | None = None, **options: Any) -> None:
    """Start the default process group for ``device_type`` (gloo, nccl or hccl), from
    torchrun's environment unless ``options`` say otherwise. ``timeout_s``: how long each
    collective waits for its peers before it raises, so that a dead or stopped peer ends
    in an error (and a torchrun restart) instead of a hang."""
    import torch.distributed as dist

    device = current_device(device_type)
    if device.type != "cpu":
        options.setdefault("device_id", device)
    if timeout_s is not None:
        options["timeout"] = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend_for(device_type), **options)


def get_rng_state(device_type: str) -> dict[str, torch.Tensor]:
    """This process's random states: the CPU's and, on an accelerator, its current
    device's (dropout there draws from the device's generator), for an exact resume."""
    states = {"cpu_rng": torch.get_rng_state()}
    if device_type != "cpu":
        states["device_rng"] = torch.get_device_module(device_type).get_rng_state()
    return states


def set_rng_state(states: dict[str, torch.Tensor], device_type: str) -> None:
    """Restore what ``get_rng_state`` returned. A device state saved on another kind of
    device (a CPU run resumed on GPUs) has nothing to restore there and is left out."""
    torch.set_rng_state(states["cpu_rng"])
    if device_type != "cpu" and "device_rng" in states:
        torch.get_device_module(device_type).set_rng_state(states["device_rng"])


def end_process(code: int = 0) -> NoReturn:
    """End a distributed worker: destroy the process group, flush, and exit without the
    interpreter's teardown.

    ``destroy_process_group`` only drops torch's own references to the group; FSDP states
    and device meshes keep it alive until the interpreter finalizes them, and gloo's worker
    threads then end the process with SIGABRT ("terminate called without an active
    exception"; pytorch/pytorch#179291 describes the mechanism). It happened here to a
    torchrun worker that had finished its work, in about one CI run in three. Processes
    started by ``multiprocessing`` (the test harness) never finalize, so never saw it."""
    import logging
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def has_streams(device_type: str) -> bool:
    return device_type != "cpu"


def new_stream(device_type: str) -> torch.Stream | None:
    """A side stream on accelerators; ``None`` on CPU, where work is synchronous."""
    if not has_streams(device_type):
        return None
    return torch.Stream(device=current_device(device_type))


@contextlib.contextmanager
def stream_context(stream: torch.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    with stream:
        yield


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device_type: str) -> torch.Tensor:
    """A host buffer, pinned where the device can copy from pinned memory asynchronously."""
    return torch.empty(shape, dtype=dtype, pin_memory=has_streams(device_type))


def device_name(device_type: str) -> str | None:
    """The accelerator's product name (e.g. 'NVIDIA H200'), or ``None`` on CPU."""
    if device_type == "cpu":
        return None
    module = getattr(torch, device_type, None)  # torch.cuda, or torch.npu once torch_npu is loaded
    getter = getattr(module, "get_device_name", None)
    return getter() if callable(getter) else None


def peak_memory_bytes(device_type: str) -> int:
    """Peak memory so far: the accelerator's allocated high-water mark, or on CPU this
    process's resident-set high-water mark (which includes the interpreter and libraries)."""
    if device_type == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return torch.accelerator.max_memory_allocated()
