"""The Trainer's data loaders, one per data shard instead of one per process.

accelerate's ``prepare`` gives each process its own share of every batch (``num_processes`` and
``process_index`` on its batch sampler). Under FSDPTurbo a data shard is ``dp_rank`` of
``dp_size``: context-parallel and tensor-parallel peers must see the same rows (CP cuts them by
sequence inside the model, TP computes on them together). So the prepared loader's shard is
re-pointed at the data shard, the way transformers' own Trainer neutralises it for its
rank-aware ``BatchRebalanceSampler``. Each global step then holds exactly the rows one process
with ``per_device_train_batch_size x dp_size`` would take, in data-shard order.
"""

from __future__ import annotations

from typing import Any

from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

from fsdp_turbo.core.errors import ConfigError

__all__ = ["check_even_eval_batches", "feed_data_shard"]


def feed_data_shard(loader: Any, dp_rank: int, dp_size: int, world_size: int) -> Any:
    """``loader`` (as ``accelerator.prepare`` returned it) reading data shard ``dp_rank`` of ``dp_size``."""
    if dp_size == world_size:  # every process is its own data shard: accelerate's split is already right
        return loader
    if isinstance(loader, DataLoaderDispatcher):
        raise ConfigError("TrainingArguments.accelerator_config.dispatch_batches", True,
                          "set accelerator_config={'dispatch_batches': False} (every rank then reads its own rows)",
                          reason="rank 0 would split each batch over all processes, but context and tensor "
                                 "parallel peers must receive the same rows")
    for shard in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None)):
        if isinstance(shard, BatchSamplerShard | IterableDatasetShard):
            shard.num_processes, shard.process_index = dp_size, dp_rank
            return loader
    raise ConfigError("train_dataset", type(getattr(loader, "dataset", None)).__name__,
                      "pass a map-style dataset (datasets.Dataset) or an IterableDataset",
                      reason="accelerate did not shard this loader, so its rows cannot be given to each data shard")


def check_even_eval_batches(dataset: Any, batch_size: int, dp_size: int, world_size: int) -> None:
    """Evaluation gathers every process's losses; context and tensor parallel peers send copies of
    the same ones, which leave a mean unchanged, except where accelerate trims the last, partial
    batch by counting rows as if each process had its own. Refused rather than averaged wrongly."""
    if dp_size == world_size or not hasattr(dataset, "__len__"):
        return
    rows = len(dataset)
    if rows % (batch_size * dp_size):
        raise ConfigError("eval_dataset", f"{rows} rows", f"evaluate a multiple of per_device_eval_batch_size x "
                          f"{dp_size} data shards = {batch_size * dp_size} rows, or change "
                          f"per_device_eval_batch_size", reason="with context or tensor parallel peers, a partial "
                          "last eval batch would be trimmed from the wrong ranks' losses")
