"""Training checkpoints: the trainable parameters and their optimizer state, sharded (DCP: each
rank writes its own shards, and a later job reads them back at another layout), written
atomically, and, if asked, in the background while training goes on.

```python
saver = TrainingCheckpointer(async_save=True)        # every rank, once per run
for step in range(1, steps + 1):
    ...                                               # forward, backward, optimizer step
    if step % 100 == 0:
        saver.save(f"ckpt/step-{step}", model, optimizer, meta={"step": step})
saver.wait()                                          # the last save is complete on disk
...
meta = load_training_checkpoint("ckpt/step-100", model, optimizer)
```

**Atomic.** Every rank writes into ``FOLDER.partial``; once every rank's shards are written,
rank 0 adds ``meta.json`` (the caller's ``meta``: JSON, data only), flushes the folder to disk
and renames it into place. A crash or a ``kill -9`` mid-save leaves only the ``.partial``
folder; the checkpoint before it is untouched.

**In the background** (``async_save=True``, as torchtitan, Megatron and VeOmni save): ``save``
returns once this rank has copied its shards to host memory (pinned memory on CUDA, the same
buffers from one save to the next); a thread then writes them while training goes on. DCP's
collectives run on a gloo group of the checkpointer's own, so they never interleave with
training's on the default group. At most one save is in flight: ``save`` and ``wait`` first
finish the one before. A background failure is raised by ``wait`` (or the next ``save``) on
every rank, with the failing rank's message.

Every rank calls every method here, in the same order: each is collective.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fsdp_turbo.checkpoint import safe_dcp
from fsdp_turbo.checkpoint.atomic import fsync_tree, move_into_place
from fsdp_turbo.checkpoint.strided import for_dcp, from_dcp
from fsdp_turbo.core.agreement import every_rank_or_none
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.stage_part import stage_parts

META = "meta.json"
# Frozen parameters (a LoRA model's base) never change: the model's source holds them, so a
# training checkpoint is the trainable parameters and their optimizer state only. The
# optimizer's state and hyperparameters are keyed by parameter name ("flattened"), so a
# rank of any layout, pipeline stages included, finds its own.
TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True, flatten_optimizer_state_dict=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _stage_view(optimizer: torch.optim.Optimizer, part: torch.nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` restricted to ``part``'s parameters, for torch's state-dict functions,
    which take one module: the same state tensors and hyperparameters, in a shallow copy."""
    mine = {id(p) for p in part.parameters()}
    view = copy.copy(optimizer)
    view.param_groups = [{**group, "params": [p for p in group["params"] if id(p) in mine]}
                         for group in optimizer.param_groups]
    view.param_groups = [group for group in view.param_groups if group["params"]]
    view.state = defaultdict(dict, {p: optimizer.state[p] for group in view.param_groups for p in group["params"]
                                    if p in optimizer.state})
    return view


def _adopt(optimizer: torch.optim.Optimizer, view: torch.optim.Optimizer) -> None:
    """What loading put into a stage's view, back into ``optimizer``: its parameters' state and
    the hyperparameters of the groups they belong to."""
    for param, state in view.state.items():
        optimizer.state[param] = state
    for loaded in view.param_groups:
        first = loaded["params"][0]
        group = next(g for g in optimizer.param_groups if any(p is first for p in g["params"]))
        group.update({key: value for key, value in loaded.items() if key != "params"})


def _pairs(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
           ) -> list[tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
    """(module, optimizer) of each pipeline stage this rank holds (one pair without a pipeline)."""
    parts = stage_parts(model)
    if len(parts) == 1 or optimizer is None:
        return [(part, optimizer) for part in parts]
    return [(part, _stage_view(optimizer, part)) for part in parts]


def _merged(states: list[dict[str, Any]]) -> dict[str, Any]:
    # names are the whole model's and the optimizer's are flattened: the stages' keys never collide
    return {kind: {key: value for state in states for key, value in state[kind].items()} for kind in states[0]}


def trainable_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a training checkpoint holds, as DCP takes it: each rank's shards of the trainable
    parameters and of their optimizer state (LoRA experts' strided shards as plain-sharded
    views), over every pipeline stage it holds."""
    states = []
    for part, part_optimizer in _pairs(model, optimizer):
        model_state, optimizer_state = get_state_dict(part, part_optimizer, options=TRAINABLE_ONLY)
        states.append({"model": model_state, "optimizer": optimizer_state})
    return for_dcp(_merged(states))


def read_trainable_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load the DCP state a :class:`TrainingCheckpointer` wrote into ``folder``, at this job's
    layout (DCP reshards), as data only (``safe_dcp``); without ``optimizer``, the parameters
    alone. Every rank calls this."""
    pairs = _pairs(model, optimizer)
    originals = []
    for part, part_optimizer in pairs:
        if part_optimizer is None:
            originals.append({"model": get_model_state_dict(part, options=TRAINABLE_ONLY)})
        else:
            model_state, optimizer_state = get_state_dict(part, part_optimizer, options=TRAINABLE_ONLY)
            originals.append({"model": model_state, "optimizer": optimizer_state})
    original = _merged(originals)
    state = for_dcp(original)
    safe_dcp.load(state, Path(folder))
    state = from_dcp(state, original)
    # not strict: the frozen parameters are absent by design (safe_dcp.load has already
    # refused a checkpoint lacking any trainable one)
    loose = StateDictOptions(ignore_frozen_params=True, strict=False, flatten_optimizer_state_dict=True)
    for (part, part_optimizer), own in zip(pairs, originals, strict=True):
        mine = {kind: {key: state[kind][key] for key in own[kind]} for kind in own}
        if part_optimizer is None:
            set_model_state_dict(part, mine["model"], options=loose)
            continue
        set_state_dict(part, part_optimizer, model_state_dict=mine["model"], optim_state_dict=mine["optimizer"],
                       options=loose)
        if part_optimizer is not optimizer:
            _adopt(optimizer, part_optimizer)


def read_meta(folder: str | Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint folder (JSON: data only)."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise TypeError(f"a {type(meta).__name__}, not an object")
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(META, str(path), f"delete {folder} (or move it away) and resume from another "
                              "checkpoint", reason=f"it cannot be read as a checkpoint's metadata "
                              f"({type(error).__name__}: {error})") from None
    return meta


def load_training_checkpoint(folder: str | Path, model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a complete checkpoint that :class:`TrainingCheckpointer` wrote into ``model`` and
    ``optimizer`` (at this job's layout), and return its ``meta``. Every rank calls this."""
    with every_rank_or_none("read the checkpoint's meta.json"):
        meta = read_meta(folder)
    read_trainable_state(folder, model, optimizer)
    return meta


class TrainingCheckpointer:
    """Writes a run's training checkpoints, one after another: synchronously, or in the background
    with at most one in flight (``async_save``). ``device``: where the agreements between ranks
    run (the training's device type). ``timeout_s``: the background group's collective timeout."""

    def __init__(self, *, async_save: bool = False, device: torch.device | str = "cpu",
                 timeout_s: float | None = None) -> None:
        self.async_save = async_save
        self.device = torch.device(device)
        self._pending: Future | None = None
        self._pending_folder: Path | None = None
        self._group = self._stager = self._thread = None
        if async_save:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if dist.is_initialized():  # collective: every rank makes the group
                timeout = timedelta(seconds=timeout_s) if timeout_s else None
                self._group = dist.new_group(backend="gloo", timeout=timeout)
            pinned = self.device.type == "cuda"  # host copies of device tensors; a CPU tensor is copied as it is
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp-turbo-checkpoint")

    @property
    def in_flight(self) -> Path | None:
        """The folder of the save still being written in the background, if any."""
        return self._pending_folder

    def save(self, folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             meta: dict[str, Any] | None = None, *, rank_files: Callable[[Path], None] | None = None,
             before_complete: Callable[[], None] | None = None,
             on_complete: Callable[[Path], None] | None = None) -> None:
        """Save into ``folder`` (complete once written: see the module's docs). ``rank_files(partial)``:
        this rank's own small files, written now into the partial folder (RNG states).
        ``before_complete()``: on every rank once its shards are written (fault injection).
        ``on_complete(folder)``: on rank 0 once the folder is in place (retention)."""
        self.wait()
        final = Path(folder)
        partial = final.with_name(f"{final.name}.partial")
        text = json.dumps(meta or {}, indent=1)  # the meta of this moment, whatever changes after
        with every_rank_or_none(f"begin the checkpoint {_label(final)}", self.device):
            if _rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)  # left by a crash
                partial.mkdir(parents=True)
        with every_rank_or_none(f"begin the checkpoint {_label(final)}", self.device):
            if rank_files is not None:
                rank_files(partial)
        state = trainable_state(model, optimizer)
        finish = _Completion(partial, final, text, before_complete, on_complete)
        if not self.async_save:
            dcp.save(state, checkpoint_id=str(partial))
            finish.run(self.device, None)
            return
        # staged (copied to host memory) before it returns; written by DCP's thread
        upload = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._group,
                                async_stager=self._stager)
        self._pending = self._thread.submit(_after, upload, finish, self._group)
        self._pending_folder = final

    def wait(self) -> None:
        """Until the save in flight (if any) is complete; its failure, on any rank, is raised on every rank."""
        if self._pending is None:
            return
        pending, folder = self._pending, self._pending_folder
        self._pending = self._pending_folder = None
        with every_rank_or_none(f"write the checkpoint {_label(folder)} in the background", self.device):
            pending.result()

    def close(self) -> None:
        """Finish the save in flight and release the staging buffers and the thread."""
        self.wait()
        if self._stager is not None:
            self._stager.close()
        if self._thread is not None:
            self._thread.shutdown()


class _Completion:
    """What follows the shards, each part agreed on by every rank: the fault hook on every rank;
    then on rank 0 ``meta.json``, the flush to disk (every rank's files: the ranks share the
    folder), the rename and ``on_complete``. A folder is completed only when every rank's part
    before it succeeded."""

    def __init__(self, partial: Path, final: Path, meta_text: str, before: Callable[[], None] | None,
                 on_complete: Callable[[Path], None] | None) -> None:
        self.partial, self.final, self.meta_text = partial, final, meta_text
        self.before, self.on_complete = before, on_complete

    def run(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        with every_rank_or_none(f"finish the shards of {_label(self.final)}", device, group):
            if self.before is not None:
                self.before()
        with every_rank_or_none(f"complete the checkpoint {_label(self.final)}", device, group):
            if _rank() == 0:
                (self.partial / META).write_text(self.meta_text, encoding="utf-8")
                fsync_tree(self.partial)
                move_into_place(self.partial, self.final)
                if self.on_complete is not None:
                    self.on_complete(self.final)


def _label(folder: Path) -> str:
    """A checkpoint's name in messages: its folder and the one above (``run/step-4``, ``checkpoint-4/state``)."""
    return f"{folder.parent.name}/{folder.name}"


def _after(upload: Future, finish: _Completion, group: dist.ProcessGroup | None) -> None:
    """The background thread's part after DCP's: DCP's future fails alike on every rank (its
    coordinator gathers every rank's write), and completes once every rank's shards and the
    checkpoint's ``.metadata`` are written. The agreements run on the checkpointer's gloo group."""
    upload.result()
    finish.run(torch.device("cpu"), group)
