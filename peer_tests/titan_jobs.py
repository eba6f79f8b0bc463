"""torchtitan's own models for the peer tests (torchtitan 0.2.2, the last release that
trains on CPU: 0.3's language models use FlexAttention, which has no CPU backward).

Test-side settings, gaps of the CPU build rather than of FSDPTurbo, kept here:
- ``init_weights()`` runs under ``torch.no_grad()`` (it fills leaf parameters in place);
- ``attn_type="sdpa"`` (the default of the debug models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 256, 32, 4, 4
# torchtitan's Llama 3 debug model, smaller: 2 layers, 4 heads of 16, 2 K/V heads (GQA).
LLAMA = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": VOCAB, "multiple_of": 32,
         "max_seq_len": 64, "rope_theta": 500000}
# The patterns a user writes for torchtitan's names: no model change.
TITAN_TP = {"colwise_parallel": ["layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv",
                                 "layers.*.feed_forward.w1", "layers.*.feed_forward.w3"],
            "rowwise_parallel": ["layers.*.attention.wo", "layers.*.feed_forward.w2"]}
TITAN_BLOCKS = ["layers.*"]
# What torchtitan's model is, said once (it does not describe itself as HF models do): its
# head (no get_output_embeddings()), its embedding, its core attention (the ``inner_attention``
# module, SDPA's form), and its forward's ``tokens`` / ``positions`` arguments.
TITAN_FACTS = {"blocks": TITAN_BLOCKS, "head_module": "output", "embedding_module": "tok_embeddings",
               "attention_modules": ["layers.*.attention.inner_attention"], "token_input": "tokens",
               "position_input": "positions"}
# Sequence parallel between the TP regions: the norms (it gathers before the facts' head).
TITAN_SP = {**TITAN_TP, "sequence_parallel": ["layers.*.attention_norm", "layers.*.ffn_norm", "norm"]}


def titan_llama(seed: int = 0) -> nn.Module:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    torch.manual_seed(seed)
    model = Transformer(TransformerModelArgs(**LLAMA))
    with torch.no_grad():
        model.init_weights()
    return model


def logits_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """torchtitan's models return logits; the loop computes the loss (next-token CE). Under
    loss parallel the logits are vocab-sharded, and the loop calls FSDPTurbo's
    ``vocab_parallel_cross_entropy`` instead of ``F.cross_entropy`` (as torchtitan's own loop
    enters ``loss_parallel()``)."""
    from torch.distributed.tensor import DTensor

    logits = model(batch)
    if isinstance(logits, DTensor):
        from fsdp_turbo.distributed.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits[:, :-1], batch[:, 1:])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())


def batches() -> list[torch.Tensor]:
    return make_token_batches(vocab_size=VOCAB, global_batch=GLOBAL_BATCH, seq_len=SEQ, steps=STEPS)


def reference_run():
    return train_steps(titan_llama(), batches(), loss_fn=logits_loss)


def turbo_run(config: dict):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, titan_llama())
    state = model.parallel_state
    mine = [shard_rows(b, state.dp_rank, state.dp_size) for b in batches()]
    return train_steps(model, mine, loss_fn=logits_loss)


def each_layout(job, configs: dict[str, dict]) -> dict:
    """``job(config)`` for every named layout in turn, inside one launch: a start of the
    ranks (spawn, imports, process group) costs about as much as training a layout."""
    return {name: job(config) for name, config in configs.items()}
