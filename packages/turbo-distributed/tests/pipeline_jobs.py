"""Rank functions of the pipeline-parallel parity tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import TrainRecord, full_tensor, make_token_batches, seed_everything, shard_rows

VOCAB = 256
GLOBAL_BATCH = 8
SEQ = 16
STEPS = 3
LR = 1e-2


def model_of(layers: int):
    return tiny_hf_causal_lm("llama", seed=0, num_hidden_layers=layers, vocab_size=VOCAB, tie_word_embeddings=False)


def batches() -> list[torch.Tensor]:
    return make_token_batches(vocab_size=VOCAB, global_batch=GLOBAL_BATCH, seq_len=SEQ, steps=STEPS)


def pipeline_records(layouts: dict[str, tuple[int, dict]]) -> dict[str, TrainRecord]:
    """Each layout (decoder layers, FSDPTurbo config) trained for ``STEPS`` AdamW steps through
    ``model.fsdp_turbo_pipeline.step``: the losses (mean over data shards) and this rank's
    stages' first-step gradients, gathered whole."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    records = {}
    for name, (layers, config) in layouts.items():
        seed_everything(0)
        model = FSDPTurbo(config, model_of(layers))
        runner, state = model.fsdp_turbo_pipeline, model.parallel_state
        optimizer = torch.optim.AdamW(list(runner.parameters()), lr=LR, foreach=False)
        record = TrainRecord()
        for step, batch in enumerate(batches()):
            shard = shard_rows(batch, state.dp_rank, state.dp_size)
            loss = runner.step(shard, shard.clone())
            total = loss.detach().double().reshape(1).clone()
            dist.all_reduce(total)  # every rank holds its data shard's loss
            record.losses.append(float(total) / dist.get_world_size())
            if step == 0:
                record.grads = {name: full_tensor(p.grad) for part in runner.parts
                                for name, p in part.named_parameters() if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        records[name] = record
    return records
