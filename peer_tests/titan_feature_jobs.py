"""Rank functions for the feature tests on torchtitan's Llama 3 (mixed precision, the swaps,
MXFP8, compile, the 8-rank row); the model, data and loss are ``titan_jobs``'s.

Several layouts train one after another inside one launch (each from the same seed, each
recorded on its own), so a test file pays one 4-rank start-up for all of them."""

from __future__ import annotations

import torch
from titan_jobs import batches, logits_loss, titan_llama

from fsdp_turbo.core.testing import TrainRecord, shard_rows, train_steps
from fsdp_turbo.core.testing.parity import full_tensors

LR = 1e-2
# MXFP8 by pattern on torchtitan's names: every Linear of the blocks, not the output head.
# dim 64, K/V 32, FFN hidden 192: every dimension holds whole blocks of 32.
TITAN_LINEARS = ["layers.*.attention.wq", "layers.*.attention.wk", "layers.*.attention.wv", "layers.*.attention.wo",
                 "layers.*.feed_forward.w1", "layers.*.feed_forward.w2", "layers.*.feed_forward.w3"]
MX_PLAN = {"quant_format": "E4M3", "block_size": 32, "apply_modules": TITAN_LINEARS}


# ----- one-process references ------------------------------------------------------------------
def mx_reference_run() -> TrainRecord:
    """The emulated-MX model (float32 master weights, fake-quantized GEMMs) in one process."""
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.converter import convert_model

    model = titan_llama()
    convert_model(model, QuantizeConfig(**MX_PLAN))
    return train_steps(model, batches(), loss_fn=logits_loss)


def mixed_precision_reference_run(shards: int, param_dtype: torch.dtype = torch.bfloat16) -> TrainRecord:
    """FSDP2's precision policy (``param_dtype`` compute, float32 reduction and master weights)
    applied in one process: each of ``shards`` data shards runs forward and backward with
    its parameters cast to ``param_dtype`` (``functional_call``: buffers such as the complex
    ``freqs_cis`` keep their dtype, as under FSDP), its gradients are cast to float32 and
    averaged over the shards in float32, and AdamW steps the float32 parameters."""
    from torch.func import functional_call

    model = titan_llama()
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(params.values(), lr=LR, foreach=False)
    record = TrainRecord()
    for step, batch in enumerate(batches()):
        losses, grads = [], {name: torch.zeros_like(p) for name, p in params.items()}
        for shard in range(shards):
            low = {name: p.detach().to(param_dtype).requires_grad_() for name, p in params.items()}
            rows = shard_rows(batch, shard, shards)
            loss = logits_loss(lambda ids, low=low: functional_call(model, low, (ids,)), rows)
            loss.backward()
            losses.append(float(loss.detach().double()))
            for name, p in low.items():
                grads[name] += p.grad.float()
        record.losses.append(sum(losses) / shards)
        for name, p in params.items():
            p.grad = grads[name] / shards
        if step == 0:
            record.grads = full_tensors({name: p.grad for name, p in params.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


def references(shards: int) -> dict[str, TrainRecord]:
    """Every reference of the feature tests, from one process: float32, the mixed-precision
    policy over ``shards`` data shards, and the emulated-MX model."""
    from titan_jobs import reference_run

    return {"fp32": reference_run(), "bf16": mixed_precision_reference_run(shards), "mx": mx_reference_run()}


# ----- the distributed runs --------------------------------------------------------------------
def _memory_facts(model, optimizer) -> dict:
    """What the memory features did: activations swapped out, optimizer-state swap-ins, and
    the dtypes the parameters are kept in (the master weights)."""
    from fsdp_turbo.memory.swap_activation.transform import SWAPPER_ATTR

    swapper = getattr(model, SWAPPER_ATTR, None)
    optimizer_swapper = getattr(optimizer.state, "_swapper", None)
    return {"activations_swapped_out": swapper.stats.tensors_out if swapper else 0,
            "optimizer_swap_ins": sum(optimizer_swapper.stats.swap_ins.values()) if optimizer_swapper else 0,
            "master_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _compile_facts() -> dict:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted({reason.splitlines()[0] for reason in counters["graph_break"]}),
            "graphs": counters["stats"]["unique_graphs"]}


def layout_run(config: dict) -> tuple[TrainRecord, dict]:
    """One layout through ``FSDPTurbo(config, model)`` on this rank's data shard."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, titan_llama())
    state = model.parallel_state
    mine = [shard_rows(b, state.dp_rank, state.dp_size) for b in batches()]
    optimizers = []

    def build(params):
        optimizers.append(torch.optim.AdamW(params, lr=LR, foreach=False))
        return optimizers[-1]

    record = train_steps(model, mine, loss_fn=logits_loss, optimizer_factory=build)
    facts = _memory_facts(model, optimizers[0])
    if config.get("compile"):
        facts.update(_compile_facts())
    facts["modules"] = {name: type(module).__name__ for name, module in model.named_modules()}
    return record, facts


def layouts_run(configs: dict[str, dict]) -> dict[str, tuple[TrainRecord, dict]]:
    """Each named layout trained in turn on these ranks (one launch for all of them)."""
    return {name: layout_run(config) for name, config in configs.items()}
