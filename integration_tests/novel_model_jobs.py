"""A model the library has never seen (not Hugging Face's, no family file): attention with
learned sinks (one logit per head) and a low-rank key/value latent every head reads, and an
MoE block whose router is named ``selector``. Its facts are declared in the config's
``model_facts`` section (or by ``register_family``), never in library source. Rank functions
are importable by spawned ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.lm_loss import lm_loss
from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import ExpertMLPList, SwiGLUExpert
from fsdp_turbo.core.testing.parity import seed_everything

HIDDEN, HEADS, HEAD_DIM, LATENT, VOCAB, EXPERTS = 64, 4, 16, 16, 256, 4
BATCHES = make_token_batches(vocab_size=VOCAB, global_batch=8, seq_len=16, steps=3)

# What the config says of the model: its head and embedding, its head counts, the per-head sinks,
# the latent every head reads (and its norm), the router, the experts.
FACTS = {"head_module": "head", "embedding_module": "embed", "num_attention_heads": HEADS,
         "num_key_value_heads": HEADS, "head_parameters": ["blocks.*.attn.sinks"],
         "latent_modules": ["blocks.*.attn.kv_latent", "blocks.*.attn.latent_norm"],
         "router_modules": ["blocks.*.moe.selector"], "expert_modules": ["blocks.*.moe.experts"]}
TP = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
      "tp_plan": {"colwise_parallel": ["*.attn.q", "*.attn.k_up", "*.attn.v_up"], "rowwise_parallel": ["*.attn.o"]}}
EP = {"expert_parallel_size": 2, "ep_plan": {"apply_modules": ["*.moe.experts"], "dispatcher": "fused"}}


class SinkLatentAttention(nn.Module):
    """Causal attention whose keys and values come up from one latent (every head reads it)
    and whose softmax joins a learned sink logit per head."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.kv_latent = nn.Linear(HIDDEN, LATENT, bias=False)
        self.latent_norm = nn.RMSNorm(LATENT)
        self.k_up = nn.Linear(LATENT, HEADS * HEAD_DIM, bias=False)
        self.v_up = nn.Linear(LATENT, HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.sinks = nn.Parameter(torch.randn(HEADS) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        latent = self.latent_norm(self.kv_latent(x))
        q, k, v = (t.view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for t in (self.q(x), self.k_up(latent),
                                                                          self.v_up(latent)))
        scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        sinks = self.sinks[None, :, None, None].expand(batch, -1, seq, 1)  # this rank's heads under TP
        weights = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        return self.o((weights @ v).transpose(1, 2).reshape(batch, seq, -1))


class SelectorMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.selector = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = ExpertMLPList([SwiGLUExpert(HIDDEN, 32) for _ in range(EXPERTS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, index = self.selector(flat).softmax(-1).topk(2, dim=-1)
        return self.experts(flat, index, weights / weights.sum(-1, keepdim=True)).view_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.moe_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.attn, self.moe = SinkLatentAttention(), SelectorMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class NovelLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def novel_model() -> NovelLM:
    seed_everything(0)
    return NovelLM()


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(model, F.pad(ids[:, 1:], (0, 1), value=-100), input_ids=ids)


def reference_run():
    return train_steps(novel_model(), BATCHES, loss_fn=loss_of)


def novel_run(layout: dict, declare: str = "config"):
    """The layout with the model's facts declared in ``model_facts`` (``declare="config"``), or
    by a family registered in code (``"family"``: the same facts by class)."""
    from fsdp_turbo.core.families import Family, HeadParameter, LatentModule, register_family, unregister_family
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    facts = dict(FACTS)
    if declare == "family":
        for name in ("head_parameters", "latent_modules"):  # the router is a plain Linear: by pattern only
            facts.pop(name)
        register_family(Family(name="novel", head_parameters=(HeadParameter("SinkLatentAttention", "sinks"),),
                               latent_modules=(LatentModule("SinkLatentAttention", "kv_latent"),
                                               LatentModule("SinkLatentAttention", "latent_norm"))))
    try:
        model = FSDPTurbo({**layout, "model_facts": facts}, novel_model())
        applied = model.fsdp_turbo_facts
        state = model.parallel_state
        local = [shard_rows(batch, state.dp_rank, state.dp_size) for batch in BATCHES]
        record = train_steps(model, local, loss_fn=loss_of)
    finally:
        unregister_family("novel")
    return record, [(p.module, p.parameter) for p in applied.head_parameters], \
        [latent.module for latent in applied.latent_modules], list(applied.routers)
