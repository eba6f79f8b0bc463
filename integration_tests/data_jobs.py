"""Rank functions for the data pipeline's parity tests (importable by spawned ranks).

The claim under test: a packed batch trains exactly as its documents would, each run
alone. The reference runs every piece of every window as its own sequence, in one
process, and takes the token-weighted mean of their losses; the candidate runs the
packed windows through FSDPTurbo (FSDP2 x TP2 with sequence parallel and a
loss-parallel head, or CP2 x FSDP2), each data shard its own windows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_turbo.core.testing import train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny"
STEPS = 3
MICRO_BATCH = 2
SEQ_LEN = 64
VOCAB = 2048
QKV = ["*.q_proj", "*.k_proj", "*.v_proj"]
LAYOUTS = {
    "fsdp2_tp2_sp": {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
                     "tp_plan": {"colwise_parallel": [*QKV, "*.gate_proj", "*.up_proj", "lm_head"],
                                 "rowwise_parallel": ["*.o_proj", "*.down_proj"],
                                 "sequence_parallel": ["*layernorm", "model.norm"], "loss_parallel": True}},
    "cp2_fsdp2": {"fully_shard_parallel_size": 2, "context_parallel_size": 2},
    "ring_cp4": {"context_parallel_size": 4, "cp_plan": {"mode": "ring"}},
    "hsdp2x2_chunk_loss": {"data_parallel_size": 2, "fully_shard_parallel_size": 2, "chunk_loss": True,
                           "chunk_loss_plan": {"chunk_size": 48}},
}
DP = {"fsdp2_tp2_sp": 2, "cp2_fsdp2": 2, "ring_cp4": 1, "hsdp2x2_chunk_loss": 4}


def data_section(**overrides):
    from fsdp_turbo.cli.job_config import DataSection

    fields = {"tokenizer": str(EXAMPLE / "tokenizer"), "seq_len": SEQ_LEN,
              "sources": [{"path": str(EXAMPLE / "train.jsonl"), "messages_field": "messages"}],
              "eval": {"sources": [{"path": str(EXAMPLE / "valid.jsonl"), "messages_field": "messages"}],
                       "batches": 2}}
    return DataSection.from_dict({**fields, **overrides})


def job_data(cache: str):
    from fsdp_turbo.cli.data import load_data

    return load_data(data_section(cache_dir=cache), cache, seed=0, vocab_size=VOCAB)


@dataclass
class Pieces:
    """A global batch as its documents: (input_ids, labels) per piece, each ``[1, length]``."""

    rows: list[tuple[torch.Tensor, torch.Tensor]]

    def to(self, _device) -> Pieces:
        return self


def pieces_of(stream, start: int, count: int) -> Pieces:
    rows = []
    for source, window in stream.windows_at(start, count):
        rows += pieces_of_window(stream.sources[source], window)
    return Pieces(rows)


def each_document_alone(model, batch: Pieces) -> torch.Tensor:
    """The token-weighted mean loss of the pieces, each its own forward."""
    total, count = 0.0, 0
    for ids, labels in batch.rows:
        tokens = int((labels[:, 1:] != -100).sum())
        if tokens:
            total = total + model(input_ids=ids, labels=labels).loss * tokens
            count += tokens
    return total / count


def reference(cache: str, dp: int):
    """Single process: every document alone; the eval loss the same way (``dp`` data shards'
    windows: the global batches and eval batches of the packed run)."""
    data = job_data(cache)
    model = tiny_hf_causal_lm("llama", vocab_size=VOCAB)
    global_batch = MICRO_BATCH * dp
    batches = [pieces_of(data.train, step * global_batch, global_batch) for step in range(STEPS)]
    record = train_steps(model, batches, loss_fn=each_document_alone)
    held_out = data.eval
    evaluated = Pieces([])
    for source, window in held_out.index[: 2 * MICRO_BATCH * dp]:  # 2 eval batches on dp data shards
        evaluated.rows += pieces_of_window(held_out.sources[source], window)
    with torch.no_grad():
        eval_loss = float(each_document_alone(model, evaluated))
    return record, eval_loss


def pieces_of_window(prepared, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each piece of a window alone; its first label ignored, as in the packed row."""
    rows = []
    for doc, begin, length in prepared.windows.pieces(window):
        row = prepared.tokens.slice(doc, 1).to_pylist()[0]
        labels = torch.tensor(row["labels"][begin:begin + length])
        labels[0] = -100
        rows.append((torch.tensor(row["input_ids"][begin:begin + length])[None], labels[None]))
    return rows


def packed_run(cache: str, layout: str):
    """A rank of the packed run: the facade over the layout, each data shard its windows."""
    from fsdp_turbo.cli.evaluation import evaluate, items_per_rank
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    data = job_data(cache)
    model = FSDPTurbo(LAYOUTS[layout], tiny_hf_causal_lm("llama", vocab_size=VOCAB))
    state = model.parallel_state
    assert state.dp_size == DP[layout]
    device = torch.device("cpu")
    batches = [data.train.next_batch(MICRO_BATCH, state.dp_rank, state.dp_size) for _ in range(STEPS)]
    assert sum(int((b.position_ids[:, 1:] == 0).sum()) for b in batches) > STEPS  # several documents a row

    def packed_loss(m, batch):
        return m(**batch.model_inputs(), num_items_in_batch=items_per_rank([batch], device)).loss

    record = train_steps(model, batches, loss_fn=packed_loss)
    evaluation = evaluate(model, data.eval, MICRO_BATCH, 2, state.dp_rank, state.dp_size, device)
    return record, evaluation["eval_loss"]
