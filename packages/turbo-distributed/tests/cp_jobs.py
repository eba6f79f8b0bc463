"""Rank functions and a tiny non-HF model for the context-parallel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.core.testing.parity import seed_everything

# Sequence 15 (not a multiple of 2 or 4); about a quarter of the labels ignored, and the
# last five positions all ignored, so the last CP=4 chunk has no valid label at all.
ODD_BATCHES = make_token_batches(vocab_size=256, global_batch=4, seq_len=15, steps=4, seed=77)


def _labels(batch: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int(batch.sum()))
    labels = batch.masked_fill(torch.rand(batch.shape, generator=generator) < 0.25, -100)
    labels[:, -5:] = -100
    return labels


def masked_label_loss(model, batch):
    return model(input_ids=batch, labels=_labels(batch)).loss


def padded_loss(model, batch):
    """Right padding: the last 3 tokens of odd rows are padding (mask 0, label -100)."""
    mask = torch.ones_like(batch)
    mask[1::2, -3:] = 0
    labels = batch.masked_fill(mask == 0, -100)
    return model(input_ids=batch, attention_mask=mask, labels=labels).loss


LOSSES = {"masked": masked_label_loss, "padded": padded_loss}


def reference_run(kind, batches, model_kwargs=None, loss=None):
    model = tiny_hf_causal_lm(kind, **(model_kwargs or {}))
    return train_steps(model, batches, **({"loss_fn": LOSSES[loss]} if loss else {}))


def cp_run(kind, batches, config, model_kwargs=None, loss=None):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, tiny_hf_causal_lm(kind, **(model_kwargs or {})))
    state = model.parallel_state
    local = [shard_rows(b, state.dp_rank, state.dp_size) for b in batches]
    record = train_steps(model, local, **({"loss_fn": LOSSES[loss]} if loss else {}))
    return record, model.config._attn_implementation


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d and functional collectives by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith(("c10d::", "_c10d_functional::")) and not name.endswith(("wait_tensor", "_autograd")):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def count_collectives_run(kind, batches, config):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, tiny_hf_causal_lm(kind))
    batch = batches[0]
    model(input_ids=batch, labels=batch).loss.backward()  # warm-up: FSDP's lazy init
    model.zero_grad()
    with CollectiveCounter() as counter:
        model(input_ids=batch, labels=batch).loss.backward()
    return counter.counts


# ----- a non-HF model: its core attention is found by dotted path -------------------------
def core_attention(query, key, value):
    """The model's core attention ([B, H, S, D] in and out), looked up by name at call time."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=True)


class TinyAttentionLM(nn.Module):
    """A one-layer LM that calls ``cp_jobs.core_attention`` and follows the CP input contract
    (``position_ids``, pre-shifted ``shift_labels`` and ``num_items_in_batch``)."""

    def __init__(self, vocab: int = 256, hidden: int = 64, heads: int = 4, attention=None) -> None:
        super().__init__()
        seed_everything(3)
        self.heads = heads
        self.attention = attention  # a function bound now (as `from x import f` does), else looked up
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(64, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def loss_function(self, logits, shift_labels, num_items_in_batch):
        total = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), reduction="sum", ignore_index=-100)
        return total / num_items_in_batch

    def forward(self, input_ids, labels=None, position_ids=None, shift_labels=None, num_items_in_batch=None):
        import cp_jobs

        batch, seq = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq).expand(batch, seq)
        x = self.embed(input_ids) + self.position(position_ids)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attention = self.attention or cp_jobs.core_attention
        attended = attention(q, k, v).transpose(1, 2).flatten(2)
        logits = self.head(x + self.out(attended))
        if labels is None:
            return logits
        if shift_labels is None:
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=-100)
            num_items_in_batch = (shift_labels != -100).sum()
        return self.loss_function(logits, shift_labels, num_items_in_batch)


def tiny_lm_loss(model, batch):
    return model(input_ids=batch, labels=batch)


def tiny_lm_reference(batches):
    return train_steps(TinyAttentionLM(), batches, loss_fn=tiny_lm_loss)


def tiny_lm_cp_run(batches, config):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, TinyAttentionLM())
    state = model.parallel_state
    return train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in batches], loss_fn=tiny_lm_loss)


def cp_with_attention_bound_early(config):
    from distributed_jobs import BATCHES

    """The model keeps the function it bound at construction, so CP's replacement never runs."""

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, TinyAttentionLM(attention=core_attention))
    batch = BATCHES[0][:1]
    model(input_ids=batch, labels=batch)
    return "ran"


def cp_with_indivisible_heads(config):
    """A non-HF model with 3 heads under Ulysses CP=2: its heads are first seen at the call."""
    from distributed_jobs import BATCHES

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, TinyAttentionLM(hidden=48, heads=3))
    batch = BATCHES[0][:1]
    model(input_ids=batch, labels=batch)
    return "ran"


def cp_with_output_attentions():
    from distributed_jobs import BATCHES

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo({"context_parallel_size": 2}, tiny_hf_causal_lm("llama"))
    batch = BATCHES[0][:1]
    model(input_ids=batch, labels=batch, output_attentions=True)
    return "ran"
